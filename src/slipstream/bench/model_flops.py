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

Token mixers other than grouped-query attention (the `attention_projections`,
`attention_core_per_key` and `mixer_state` parts of a layer):
    gated attention (`attention_output_gate`, Qwen3-Next): q_proj twice as wide,
                                       2 * D * (2*H*d + 2*K*d) + 2 * H*d * D
    multi-head latent attention (`kv_lora_rank` > 0, DeepSeek-V3), n = qk_nope_head_dim,
        r = qk_rope_head_dim, v = v_head_dim, Q = q_lora_rank, L = kv_lora_rank:
                projections            2 * D * H*(n+r)  (or 2 * D * Q + 2 * Q * H*(n+r))
                                       + 2 * D * (L + r) + 2 * L * H*(n+v) + 2 * H*v * D
                scores and values      2 * H * (n+r) * c + 2 * H * v * c
    Gated DeltaNet (`linear_attention` layers), Hk/Hv key/value heads of dk/dv, C = 2*Hk*dk +
        Hv*dv the conv channels, W the conv width:
                projections            2 * D * (C + Hv*dv + 2*Hv) + 2 * Hv*dv * D
                conv and state         2 * C * W + 6 * Hv * dk * dv   (the depthwise conv; the
                                       recurrent form's three state products per token:
                                       S^T k, the rank-1 update, S^T q; no keys: c unused)
    The chunked GDN form used in prefill and training does other products (intra-chunk
    attention) of the same order; the count is the recurrent form's, the cost of the maths.

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
    mixer_state: int = 0
    """Context-independent token-mixer work (a GDN layer's conv and state products)."""

    def total(self, attended_keys: float) -> float:
        return (self.attention_projections + self.attention_core_per_key * attended_keys
                + self.mixer_state + self.router + self.experts + self.combine
                + self.shared_expert + self.dense_ffn)  # fmt: skip


def is_moe_layer(cfg: Any, layer_idx: int) -> bool:
    """The model's rule (model/transformer.py), restated here so this module needs no torch."""
    return (
        layer_idx not in cfg.mlp_only_layers
        and cfg.num_experts > 0
        and (layer_idx + 1) % cfg.decoder_sparse_step == 0
    )


def is_linear_attention_layer(cfg: Any, layer_idx: int) -> bool:
    """A Gated DeltaNet layer (model/transformer.py's rule: its `layer_types` entry)."""
    return bool(cfg.layer_types) and cfg.layer_types[layer_idx] == "linear_attention"


def gdn_dims(cfg: Any) -> tuple[int, int, int]:
    """(conv channels 2*Hk*dk + Hv*dv, value width Hv*dv, value heads Hv) of a GDN layer."""
    key = cfg.linear_num_key_heads * cfg.linear_key_head_dim
    value = cfg.linear_num_value_heads * cfg.linear_value_head_dim
    return 2 * key + value, value, cfg.linear_num_value_heads


def mixer_flops(cfg: Any, layer_idx: int) -> tuple[int, int, int]:
    """(projections, core per attended key, context-independent state work) of the token mixer
    of layer `layer_idx`: forward FLOPs per token (see the module docstring)."""
    D, H, K, d = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    if is_linear_attention_layer(cfg, layer_idx):
        conv, value, Hv = gdn_dims(cfg)
        state = 6 * Hv * cfg.linear_key_head_dim * cfg.linear_value_head_dim
        proj = 2 * D * (conv + value + 2 * Hv) + 2 * value * D
        return proj, 0, 2 * conv * cfg.linear_conv_kernel_dim + state
    if cfg.kv_lora_rank:
        qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        Q, L, v = cfg.q_lora_rank, cfg.kv_lora_rank, cfg.v_head_dim
        q = 2 * D * H * qk if Q is None else 2 * D * Q + 2 * Q * H * qk
        kv = 2 * D * (L + cfg.qk_rope_head_dim) + 2 * L * H * (cfg.qk_nope_head_dim + v)
        return q + kv + 2 * H * v * D, 2 * H * qk + 2 * H * v, 0
    q_width = 2 * H * d if cfg.attention_output_gate else H * d
    return 2 * D * (q_width + 2 * K * d) + 2 * H * d * D, 4 * H * d, 0


def layer_flops(cfg: Any, layer_idx: int) -> LayerFlops:
    """Forward FLOPs per token of layer `layer_idx` of a `ModelConfig`."""
    D = cfg.hidden_size
    proj, core, state = mixer_flops(cfg, layer_idx)
    if is_moe_layer(cfg, layer_idx):
        E, k, Ie = cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size
        Is = cfg.shared_expert_intermediate_size
        shared = 6 * D * Is + (2 * D if cfg.shared_expert_gated else 0) if Is > 0 else 0
        return LayerFlops(proj, core, 2 * D * E, 6 * D * Ie * k, 2 * D * k, shared, 0, state)
    return LayerFlops(proj, core, 0, 0, 0, 0, 6 * D * cfg.intermediate_size, state)


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


def mixer_params(cfg: Any, layer_idx: int) -> int:
    """Parameters of layer `layer_idx`'s token mixer (biases not counted: none of the families
    whose mixers this counts beyond plain attention has them at the presets' settings)."""
    D, H, K, d = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    if is_linear_attention_layer(cfg, layer_idx):
        conv, value, Hv = gdn_dims(cfg)
        # in_proj_qkv/z/b/a, depthwise conv, dt_bias + A_log, the gated norm, out_proj
        return (D * (conv + value + 2 * Hv) + conv * cfg.linear_conv_kernel_dim + 2 * Hv
                + cfg.linear_value_head_dim + value * D)  # fmt: skip
    if cfg.kv_lora_rank:
        qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        Q, L, v = cfg.q_lora_rank, cfg.kv_lora_rank, cfg.v_head_dim
        q = D * H * qk if Q is None else D * Q + Q + Q * H * qk  # q_a, its norm, q_b
        # kv_a_proj_with_mqa, its norm, kv_b_proj, o_proj
        return (
            q + D * (L + cfg.qk_rope_head_dim) + L + L * H * (cfg.qk_nope_head_dim + v) + H * v * D
        )
    q_width = 2 * H * d if cfg.attention_output_gate else H * d
    return D * (q_width + 2 * K * d) + H * d * D + 2 * d  # q, k, v, o; per-head q/k norms


def num_params(cfg: Any, *, active: bool = False) -> int:
    """Parameters of the model (embedding, every layer, final norm, LM head unless tied);
    `active`: with only k of the E experts of each MoE layer counted."""
    D = cfg.hidden_size
    total = cfg.vocab_size * D + D  # embedding + final norm
    if not cfg.tie_word_embeddings:
        total += cfg.vocab_size * D
    for i in range(cfg.num_hidden_layers):
        total += mixer_params(cfg, i) + 2 * D  # the token mixer, the layer's two norms
        if is_moe_layer(cfg, i):
            experts = cfg.num_experts_per_tok if active else cfg.num_experts
            total += D * cfg.num_experts + experts * 3 * D * cfg.moe_intermediate_size
            if cfg.shared_expert_intermediate_size > 0:
                gate = D if cfg.shared_expert_gated else 0  # sigmoid gate (Qwen2-MoE's)
                total += 3 * D * cfg.shared_expert_intermediate_size + gate
        else:
            total += 3 * D * cfg.intermediate_size
    return total
