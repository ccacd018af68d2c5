"""Matmul FLOPs of the MoE model (Qwen3-MoE architecture) per token, counted from its config.

Convention: 2 FLOPs per multiply-add of every matrix product; nothing else is counted (norms,
RoPE, softmax, SiLU, the loss, top-k routing, embedding lookups and index/scatter work are
elementwise or memory work, not FLOPs here). Symbols: D hidden_size, H num_attention_heads,
K num_key_value_heads, d head_dim, E num_experts, k num_experts_per_tok, I moe_intermediate_size,
I_s shared_expert_intermediate_size, F intermediate_size (dense FFN layers), V vocab_size,
c the number of key positions a token's query attends to.

Forward FLOPs of one token:

    per layer   attention projections  2 * D * (2*H*d + 2*K*d)        (q, k, v, o)
                scores and values      4 * H * d * c                  (q k^T, p v)
                MoE layer              2 * D * E                      (router)
                                       + 6 * D * I * k                (k SwiGLU experts)
                                       + 2 * D * k                    (gate-weighted sum of
                                                                       the k outputs)
                                       + 6 * D * I_s + 2 * D          (shared expert + its gate)
                dense FFN layer        6 * D * F
    once        LM head                2 * D * V

Training (`train_flops_per_token`): forward + backward = 3 x forward. Backward computes, for
every matmul y = x W, the input gradient and the weight gradient, each as many FLOPs as the
forward product (the attention products likewise: four backward products for two forward
ones); every matmul input in this model needs its gradient (the embedding output requires grad,
so even layer 0's input gradient is computed). c is the mean number of keys a causal query
attends to, (T + 1) / 2 for a sequence of T positions (`causal=False` counts all T, which is
what a dense kernel computes and what torch's FlopCounterMode reports for SDPA).
Decode (`decode_flops_per_token`): one forward with c = the context length (cached keys + the
new one).

Not covered: the RL step's extra forwards (proximal/reference log-probs with minibatches or a
KL term, the PPO critic): the limit counts the model's fwd + bwd only; with frozen routers the
router's weight gradient (2 * D * E per token per MoE layer) is counted but not computed.
Tested against a brute-force FlopCounterMode count of a tiny model (tests/unit/test_limits.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class LayerFlops:
    """Forward FLOPs of one token in one layer, by part (attention scores excluded: they depend
    on the context, see `attention_core_per_key`)."""

    attention_projections: int
    attention_core_per_key: int
    router: int
    experts: int
    combine: int
    shared_expert: int
    dense_ffn: int

    def total(self, attended_keys: float) -> float:
        return (self.attention_projections + self.attention_core_per_key * attended_keys
                + self.router + self.experts + self.combine + self.shared_expert
                + self.dense_ffn)  # fmt: skip


def is_moe_layer(cfg: Any, layer_idx: int) -> bool:
    """The model's rule (model/transformer.py), restated here so this module needs no torch."""
    return (
        layer_idx not in cfg.mlp_only_layers
        and cfg.num_experts > 0
        and (layer_idx + 1) % cfg.decoder_sparse_step == 0
    )


def layer_flops(cfg: Any, layer_idx: int) -> LayerFlops:
    """Forward FLOPs per token of layer `layer_idx` of a `ModelConfig`."""
    D, H, K, d = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    proj = 2 * D * (2 * H * d + 2 * K * d)
    core = 4 * H * d
    if is_moe_layer(cfg, layer_idx):
        E, k, Ie = cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size
        Is = cfg.shared_expert_intermediate_size
        shared = 6 * D * Is + 2 * D if Is > 0 else 0
        return LayerFlops(proj, core, 2 * D * E, 6 * D * Ie * k, 2 * D * k, shared, 0)
    return LayerFlops(proj, core, 0, 0, 0, 0, 6 * D * cfg.intermediate_size)


def lm_head_flops(cfg: Any) -> int:
    if cfg.vocab_size <= 0:
        raise ValueError("model config has vocab_size 0: resolve it from the tokenizer first")
    return 2 * cfg.hidden_size * cfg.vocab_size


def forward_flops_per_token(cfg: Any, attended_keys: float) -> float:
    """Forward matmul FLOPs of one token whose queries attend to `attended_keys` positions."""
    layers = sum(layer_flops(cfg, i).total(attended_keys) for i in range(cfg.num_hidden_layers))
    return layers + lm_head_flops(cfg)


def mean_causal_keys(seq_len: float) -> float:
    """Mean keys per query of causal attention over a sequence of seq_len positions."""
    return (seq_len + 1) / 2


def train_flops_per_token(cfg: Any, seq_len: float, *, causal: bool = True) -> float:
    """Forward + backward matmul FLOPs per trained position of sequences seq_len positions long
    (3 x forward; see the module docstring)."""
    keys = mean_causal_keys(seq_len) if causal else seq_len
    return 3 * forward_flops_per_token(cfg, keys)


def decode_flops_per_token(cfg: Any, context_len: float) -> float:
    """Forward matmul FLOPs of one decoded token attending to `context_len` positions."""
    return forward_flops_per_token(cfg, context_len)


def num_params(cfg: Any, *, active: bool = False) -> int:
    """Parameters of the model (embedding, every layer, final norm, LM head unless tied);
    `active`: with only k of the E experts of each MoE layer counted."""
    D, H, K, d = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    total = cfg.vocab_size * D + D  # embedding + final norm
    if not cfg.tie_word_embeddings:
        total += cfg.vocab_size * D
    for i in range(cfg.num_hidden_layers):
        total += D * (2 * H * d + 2 * K * d) + 2 * d + 2 * D  # projections, q/k norms, 2 norms
        if is_moe_layer(cfg, i):
            experts = cfg.num_experts_per_tok if active else cfg.num_experts
            total += D * cfg.num_experts + experts * 3 * D * cfg.moe_intermediate_size
            if cfg.shared_expert_intermediate_size > 0:
                total += 3 * D * cfg.shared_expert_intermediate_size + D
        else:
            total += 3 * D * cfg.intermediate_size
    return total
