"""The matrix products of one training step and one decode step of the MoE model, as shapes,
and how fast this machine runs each (`bench limits`).

A `Gemm` is `count` calls per step of a (batch x) m x k @ k x n product. The shapes are those of
an ideal implementation of the model's arithmetic (bench/model_flops.py): q/k/v fused into one
projection, each expert's gate and up fused (as the checkpoint stores them), experts fed the
token count a balanced router gives them (N k / E rows each), attention as batched products per
sequence and head. For training every linear x W appears three times: forward (m, k, n), input
gradient (m, n, k) and weight gradient (n, m, k); attention's backward is three products of the
p v shape and one of the q k^T shape. Causal attention counts (T + 1) / (2 T) of the full
product (a kernel that skips masked blocks), so the step's GEMM FLOPs equal
`train_flops_per_token(cfg, T) * N` up to the rounding of rows per expert.

Other token mixers (model_flops' docstring has their FLOPs): gated attention's q projection is
twice as wide; multi-head latent attention is its q (or q_a, q_b), kv_a, kv_b and o projections
and attention with q/k (qk_nope + qk_rope) and v (v_head) widths over `num_attention_heads`; a
Gated DeltaNet layer is its input and output projections, the depthwise conv (as a 1 x W @ W x 1
product per channel) and the recurrent form's three state products per token and value head
(1 x dk @ dk x dv), with no attention over keys.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

from slipstream.bench.model_flops import (
    gdn_dims,
    is_linear_attention_layer,
    is_moe_layer,
    mean_causal_keys,
    mixer_params,
)


@dataclass(frozen=True)
class Gemm:
    name: str
    m: int
    k: int
    n: int
    batch: int = 1
    count: float = 1.0

    @property
    def flops_per_call(self) -> int:
        return 2 * self.batch * self.m * self.k * self.n


def _linear(name: str, rows: int, d_in: int, d_out: int, count: float, train: bool) -> list[Gemm]:
    if not train:
        return [Gemm(name, rows, d_in, d_out, 1, count)]
    return [Gemm(f"{name} fwd", rows, d_in, d_out, 1, count),
            Gemm(f"{name} dgrad", rows, d_out, d_in, 1, count),
            Gemm(f"{name} wgrad", d_out, rows, d_in, 1, count)]  # fmt: skip


def _merge(gemms: list[Gemm]) -> list[Gemm]:
    """One entry per distinct (name, shape): layers with equal shapes add their counts."""
    merged: dict[tuple[str, int, int, int, int], float] = {}
    for g in gemms:
        key = (g.name, g.m, g.k, g.n, g.batch)
        merged[key] = merged.get(key, 0.0) + g.count
    return [Gemm(name, m, k, n, b, c) for (name, m, k, n, b), c in merged.items()]


def _mixer_linears(cfg: Any, i: int, rows: int, train: bool) -> list[Gemm]:
    """Layer i's token-mixer products other than attention over keys (`_attention_dims`)."""
    D, H, K, d = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    passes = 3.0 if train else 1.0
    if is_linear_attention_layer(cfg, i):
        conv, value, Hv = gdn_dims(cfg)
        dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        return (_linear("gdn in_proj", rows, D, conv + value + 2 * Hv, 1, train)
                + _linear("gdn out_proj", rows, value, D, 1, train)
                + [Gemm("gdn conv", 1, cfg.linear_conv_kernel_dim, 1, rows * conv, passes),
                   Gemm("gdn state", 1, dk, dv, rows * Hv, 3 * passes)])  # fmt: skip
    if cfg.kv_lora_rank:
        qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        Q, L = cfg.q_lora_rank, cfg.kv_lora_rank
        if Q is None:
            q = _linear("mla q", rows, D, H * qk, 1, train)
        else:
            q = _linear("mla q_a", rows, D, Q, 1, train) + _linear(
                "mla q_b", rows, Q, H * qk, 1, train
            )
        kv_b = H * (cfg.qk_nope_head_dim + cfg.v_head_dim)
        return (q + _linear("mla kv_a", rows, D, L + cfg.qk_rope_head_dim, 1, train)
                + _linear("mla kv_b", rows, L, kv_b, 1, train)
                + _linear("o", rows, H * cfg.v_head_dim, D, 1, train))  # fmt: skip
    q_heads = 2 * H if cfg.attention_output_gate else H  # the gate is q_proj's second half
    return _linear("qkv", rows, D, (q_heads + 2 * K) * d, 1, train) + _linear(
        "o", rows, H * d, D, 1, train
    )


def _attention_dims(cfg: Any, i: int) -> tuple[int, int, int, int] | None:
    """(query heads, kv heads, q/k width, v width) of layer i's attention over keys; None for a
    Gated DeltaNet layer (no keys)."""
    if is_linear_attention_layer(cfg, i):
        return None
    if cfg.kv_lora_rank:
        H = cfg.num_attention_heads
        return H, H, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim
    return cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.head_dim


def _layer_linears(cfg: Any, i: int, rows: int, expert_rows: int, num_experts_hit: float,
                   train: bool) -> list[Gemm]:  # fmt: skip
    D = cfg.hidden_size
    out = _mixer_linears(cfg, i, rows, train)
    if is_moe_layer(cfg, i):
        Ie, k = cfg.moe_intermediate_size, cfg.num_experts_per_tok
        out += _linear("router", rows, D, cfg.num_experts, 1, train)
        out += _linear("expert gate_up", expert_rows, D, 2 * Ie, num_experts_hit, train)
        out += _linear("expert down", expert_rows, Ie, D, num_experts_hit, train)
        # the k expert outputs summed with their gate weights: (1 x k) @ (k x D) per token
        out.append(Gemm("combine", 1, k, D, rows, 3.0 if train else 1.0))
        Is = cfg.shared_expert_intermediate_size
        if Is > 0:
            out += _linear("shared gate_up", rows, D, 2 * Is, 1, train)
            out += _linear("shared down", rows, Is, D, 1, train)
            if cfg.shared_expert_gated:  # DeepSeek's / GLM's shared experts have no gate
                out += _linear("shared gate", rows, D, 1, 1, train)
    else:
        F = cfg.intermediate_size
        out += _linear("ffn gate_up", rows, D, 2 * F, 1, train)
        out += _linear("ffn down", rows, F, D, 1, train)
    return out


def train_gemms(cfg: Any, num_tokens: int, seq_len: float) -> list[Gemm]:
    """The products of one forward + backward over num_tokens positions in sequences of
    seq_len (num_tokens / seq_len sequences, at least 1)."""
    if num_tokens < 1 or seq_len < 1:
        raise ValueError(f"need num_tokens >= 1 and seq_len >= 1, got {num_tokens}, {seq_len}")
    E, k = cfg.num_experts, cfg.num_experts_per_tok
    expert_rows = max(1, math.ceil(num_tokens * k / E)) if E else 0
    T = max(1, round(seq_len))
    seqs = max(1, round(num_tokens / T))
    causal = mean_causal_keys(seq_len) / seq_len
    gemms: list[Gemm] = []
    for i in range(cfg.num_hidden_layers):
        gemms += _layer_linears(cfg, i, num_tokens, expert_rows, E, train=True)
        if (dims := _attention_dims(cfg, i)) is None:
            continue
        H, _, dqk, dv = dims
        # q k^T and dP = dO V^T (the v width); p v and dV = P^T dO (v), dQ and dK (q/k width)
        gemms.append(Gemm("attn q k^T", T, dqk, T, seqs * H, causal))
        gemms.append(Gemm("attn q k^T", T, dv, T, seqs * H, causal))
        gemms.append(Gemm("attn p v", T, T, dv, seqs * H, 2 * causal))
        gemms.append(Gemm("attn p v", T, T, dqk, seqs * H, 2 * causal))
    gemms += _linear("lm_head", num_tokens, cfg.hidden_size, cfg.vocab_size, 1, train=True)
    return _merge(gemms)


def experts_hit(cfg: Any, rows: int) -> float:
    """Expected experts a batch of `rows` tokens touches per MoE layer (uniform top-k routing)."""
    E, k = cfg.num_experts, cfg.num_experts_per_tok
    return E * (1 - (1 - k / E) ** rows) if E else 0.0


def decode_gemms(cfg: Any, batch: int, context_len: int) -> list[Gemm]:
    """The products of one decode step of `batch` rows, each attending to context_len keys (the
    query heads grouped under their kv head, as SDPA with enable_gqa computes them)."""
    if batch < 1 or context_len < 1:
        raise ValueError(f"need batch >= 1 and context_len >= 1, got {batch}, {context_len}")
    hit = experts_hit(cfg, batch)
    expert_rows = max(1, math.ceil(batch * cfg.num_experts_per_tok / hit)) if hit else 0
    gemms: list[Gemm] = []
    for i in range(cfg.num_hidden_layers):
        gemms += _layer_linears(cfg, i, batch, expert_rows, hit, train=False)
        if (dims := _attention_dims(cfg, i)) is None:
            continue
        H, K, dqk, dv = dims
        gemms.append(Gemm("attn q k^T", H // K, dqk, context_len, batch * K))
        gemms.append(Gemm("attn p v", H // K, context_len, dv, batch * K))
    gemms += _linear("lm_head", batch, cfg.hidden_size, cfg.vocab_size, 1, train=False)
    return _merge(gemms)


def decode_read_bytes(cfg: Any, batch: int, context_len: int, bytes_per_value: int) -> float:
    """Bytes one decode step must read at least: every weight it multiplies by (the experts a
    batch touches in expectation) and the cached keys and values of every row (a Gated DeltaNet
    layer's recurrent state and conv window instead: fixed, whatever the context; an MLA
    layer's expanded K and V, what the engine caches)."""
    D = cfg.hidden_size
    values = 0.0
    hit = experts_hit(cfg, batch)
    for i in range(cfg.num_hidden_layers):
        values += mixer_params(cfg, i)
        if (dims := _attention_dims(cfg, i)) is None:
            conv, _, Hv = gdn_dims(cfg)
            state = Hv * cfg.linear_key_head_dim * cfg.linear_value_head_dim
            values += batch * (state + conv * (cfg.linear_conv_kernel_dim - 1))
        else:
            _, K, dqk, dv = dims
            values += batch * context_len * K * (dqk + dv)  # this layer's KV cache
        if is_moe_layer(cfg, i):
            values += D * cfg.num_experts + hit * 3 * D * cfg.moe_intermediate_size
            values += 3 * D * cfg.shared_expert_intermediate_size
        else:
            values += 3 * D * cfg.intermediate_size
    values += cfg.vocab_size * D  # LM head
    return values * bytes_per_value


def time_gemm(g: Gemm, dtype: Any, device: str = "cpu", *, repeats: int = 3,
              min_time_s: float = 0.02, clock: Any = time.perf_counter) -> list[float]:  # fmt: skip
    """Seconds per call of g's product into a preallocated output, `repeats` measurements of
    enough back-to-back calls to last min_time_s (after a warm-up call), read on `clock`."""
    import torch

    shape_a = (g.batch, g.m, g.k) if g.batch > 1 else (g.m, g.k)
    shape_b = (g.batch, g.k, g.n) if g.batch > 1 else (g.k, g.n)
    a = torch.randn(shape_a, device=device).to(dtype)
    b = torch.randn(shape_b, device=device).to(dtype)
    out = torch.empty((*shape_a[:-1], g.n), device=device, dtype=dtype)
    op = torch.bmm if g.batch > 1 else torch.mm

    def sync() -> None:
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    op(a, b, out=out)
    sync()
    t0 = clock()
    op(a, b, out=out)
    sync()
    calls = max(1, int(min_time_s / max(clock() - t0, 1e-7)))
    times = []
    for _ in range(repeats):
        t0 = clock()
        for _ in range(calls):
            op(a, b, out=out)
        sync()
        times.append((clock() - t0) / calls)
    return times
