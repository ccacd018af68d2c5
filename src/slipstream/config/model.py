"""`[model]`: the MoE policy architecture. `model_type` names the family (the registry in
model/families/); the other fields are the union of what the families need, named as in Hugging
Face's `Qwen3MoeConfig` where it has the field. A family maps its `config.json` onto them
(`Family.config_from_hf`) and back (`Family.config_to_hf`), so the section maps one-to-one onto
a checkpoint of that family."""

from typing import Literal, get_args

from pydantic import Field, model_validator

from slipstream.config.base import Section

MoEImpl = Literal["grouped", "grouped_mm", "loop"]
"""The expert compute paths `model.moe_impl` may name (model/moe_block.py implements each)."""
QKNorm = Literal["per_head", "full", "none"]
"""q/k RMSNorm before RoPE: per head (Qwen3, GLM's `use_qk_norm`), over the whole projection
(OLMoE: weights (H*Dh,), (K*Dh,)), or none (Mixtral, GPT-OSS)."""
RouterScheme = Literal["softmax_topk", "sigmoid_group_topk", "topk_softmax"]
"""How a router's logits become top-k ids and weights (model/router.py): `softmax_topk`
(Qwen3-MoE, Mixtral, OLMoE: softmax over E, top-k, renormalised if `norm_topk_prob`),
`sigmoid_group_topk` (GLM-4.5 / DeepSeek-V3: sigmoid scores, selection on scores + correction
bias within the best `topk_group` of `n_group` groups, weights from the unbiased scores,
renormalised if `norm_topk_prob`, times `routed_scaling_factor`), `topk_softmax` (GPT-OSS: top-k
of the logits, softmax over the k)."""
MOE_IMPLS: tuple[str, ...] = get_args(MoEImpl)
"""The same list as a tuple (validation messages, benchmarks): one list, not a second copy."""
ExpertActivation = Literal["swiglu", "clamped_swiglu"]
"""`swiglu`: silu(gate) * up. `clamped_swiglu` (GPT-OSS): (clamp(up, -limit, limit) + 1) * g *
sigmoid(alpha * g), g = clamp(gate, max=limit)."""
LayerType = Literal["full_attention", "sliding_attention", "linear_attention"]
"""`linear_attention`: a Gated DeltaNet layer (Qwen3-Next / Qwen3.5, model/gated_deltanet.py)."""


class YarnRope(Section):
    """YaRN RoPE scaling (transformers' `rope_type = "yarn"`, `_compute_yarn_parameters`)."""

    factor: float = Field(default=1.0, gt=0)
    """Context extension factor (GPT-OSS: 32)."""
    original_max_position_embeddings: int = Field(default=4096, ge=1)
    """The pretraining context the ramp is computed against (GPT-OSS: 4096)."""
    beta_fast: float = 32.0
    """Rotations above which a frequency is extrapolated (kept)."""
    beta_slow: float = 1.0
    """Rotations below which a frequency is interpolated (divided by `factor`)."""
    truncate: bool = True
    """Round the correction range to whole dimensions (GPT-OSS: false)."""
    attention_factor: float | None = None
    """cos/sin multiplier; None: 0.1 * ln(factor) + 1 (mscale / mscale_all_dim are not read)."""
    mscale: float | None = None
    """DeepSeek's YaRN `mscale` (kept for the checkpoint; its family folds it into
    `attention_factor` on load)."""
    mscale_all_dim: float | None = None
    """DeepSeek's YaRN `mscale_all_dim`: multi-head latent attention multiplies its softmax scale
    by (0.1 * mscale_all_dim * ln(factor) + 1)^2 (model/mla.py `mla_softmax_scale`)."""


class ModelConfig(Section):
    model_type: str = "qwen3_moe"
    """The model family (HF `model_type`): a key of the registry in model/families/ (qwen3_moe,
    qwen3, mixtral, olmoe, glm4_moe, ...). Decides the checkpoint format; the architecture is the
    fields below."""
    init_from: str | None = None
    """Load weights (and architecture) from this HF-format directory instead of a random init."""
    vocab_size: int = Field(default=0, ge=0)
    """Vocabulary size; 0 takes it from the task's tokenizer."""
    hidden_size: int = Field(default=128, ge=8)
    """Residual stream width."""
    num_hidden_layers: int = Field(default=4, ge=1)
    """Decoder layers."""
    num_attention_heads: int = Field(default=4, ge=1)
    """Query heads."""
    num_key_value_heads: int = Field(default=2, ge=1)
    """Key/value heads (grouped-query attention); must divide num_attention_heads."""
    head_dim: int = Field(default=32, ge=4)
    """Per-head width."""
    intermediate_size: int = Field(default=256, ge=1)
    """FFN width of dense (non-MoE) layers."""
    moe_intermediate_size: int = Field(default=128, ge=1)
    """FFN width of each expert."""
    num_experts: int = Field(default=8, ge=1)
    """Routed experts per MoE layer."""
    num_experts_per_tok: int = Field(default=2, ge=1)
    """Top-k experts each token is routed to."""
    norm_topk_prob: bool = True
    """Renormalise the top-k routing probabilities to sum to 1."""
    decoder_sparse_step: int = Field(default=1, ge=1)
    """Every n-th layer is MoE (1 = all)."""
    mlp_only_layers: list[int] = Field(default_factory=list)
    """Layer indices that use a dense FFN instead of MoE."""
    shared_expert_intermediate_size: int = Field(default=0, ge=0)
    """Width of an always-on shared expert; 0 = none (Qwen3-MoE has none)."""
    shared_expert_gated: bool = True
    """The shared expert is scaled by sigmoid(shared_expert_gate(x)) (Qwen2-MoE); False: added
    as it is (GLM-4.5 / DeepSeek `shared_experts`)."""
    router_scheme: RouterScheme = "softmax_topk"
    """How router logits become expert ids and weights (see `RouterScheme`)."""
    router_bias: bool = False
    """A bias on the router (`mlp.gate.bias`; GPT-OSS's `mlp.router.bias`)."""
    router_correction_bias: bool = False
    """The router holds an `e_score_correction_bias` (E,) float32 buffer added to the scores for
    expert selection only (sigmoid_group_topk); it travels with checkpoints and weight pushes and
    is never trained."""
    n_group: int = Field(default=1, ge=1)
    """sigmoid_group_topk: experts are split into this many groups (must divide num_experts)."""
    topk_group: int = Field(default=1, ge=1)
    """sigmoid_group_topk: experts are chosen within the best this-many groups."""
    routed_scaling_factor: float = Field(default=1.0, gt=0)
    """sigmoid_group_topk: the routed experts' weights are multiplied by this."""
    attention_bias: bool = False
    """Biases on q/k/v_proj (GLM's, OLMoE's and GPT-OSS's HF `attention_bias`)."""
    attention_out_bias: bool = False
    """A bias on o_proj (OLMoE's and GPT-OSS's HF `attention_bias` set it too; GLM's does not)."""
    qk_norm: QKNorm = "per_head"
    """q/k RMSNorm before RoPE (see `QKNorm`)."""
    clip_qkv: float | None = Field(default=None, gt=0)
    """Clamp q, k and v to [-clip_qkv, clip_qkv] after the q/k norm (OLMoE); None: no clamp."""
    partial_rotary_factor: float = Field(default=1.0, gt=0, le=1)
    """RoPE rotates the first head_dim * factor dims of each head (GLM-4.5: 0.5)."""
    num_nextn_predict_layers: int = Field(default=0, ge=0)
    """Multi-token-prediction layers the checkpoint carries after the decoder (GLM-4.5,
    DeepSeek-V3): kept and written back with the checkpoint, not built or trained."""
    max_position_embeddings: int = Field(default=512, ge=8)
    """Longest sequence (prompt + completion) the model handles."""
    rope_theta: float = Field(default=10000.0, gt=0)
    """RoPE base frequency."""
    rms_norm_eps: float = Field(default=1e-6, gt=0)
    """RMSNorm epsilon."""
    router_aux_loss_coef: float = Field(default=0.001, ge=0)
    """Weight of the load-balancing auxiliary loss."""
    router_z_loss_coef: float = Field(default=0.0, ge=0)
    """Weight of the router z-loss (mean squared logsumexp of router logits)."""
    tie_word_embeddings: bool = False
    """Share the input embedding and the LM head."""
    attention_sinks: bool = False
    """A learned per-head sink logit (`self_attn.sinks`, GPT-OSS): an extra softmax column whose
    probability is dropped (model/attention_variants.py)."""
    sliding_window: int | None = Field(default=None, ge=1)
    """Keys a query sees in a `sliding_attention` layer, itself included."""
    layer_types: list[LayerType] = Field(default_factory=list)
    """Per layer `full_attention` or `sliding_attention` (with `sliding_window`); empty: all full."""
    rope_scaling: YarnRope | None = None
    """YaRN RoPE scaling; None: plain RoPE."""
    norm_weight_in_float32: bool = False
    """RMSNorm multiplies its weight in float32 before the cast back (GPT-OSS); false: after the
    cast (Qwen3). Equal in float32."""
    expert_bias: bool = False
    """Biases on the experts' gate_up and down projections (GPT-OSS)."""
    expert_activation: ExpertActivation = "swiglu"
    """The experts' gated activation (see `ExpertActivation`)."""
    swiglu_alpha: float = Field(default=1.702, gt=0)
    """`clamped_swiglu`'s sigmoid slope."""
    swiglu_limit: float = Field(default=7.0, gt=0)
    """`clamped_swiglu`'s clamp."""
    linear_num_key_heads: int = Field(default=0, ge=0)
    """Gated DeltaNet (`linear_attention` layers): key heads (q and k share them)."""
    linear_num_value_heads: int = Field(default=0, ge=0)
    """Gated DeltaNet value heads (a multiple of the key heads)."""
    linear_key_head_dim: int = Field(default=0, ge=0)
    """Gated DeltaNet key/query head width."""
    linear_value_head_dim: int = Field(default=0, ge=0)
    """Gated DeltaNet value head width."""
    linear_conv_kernel_dim: int = Field(default=4, ge=2)
    """Gated DeltaNet's causal depthwise conv1d width."""
    attention_output_gate: bool = False
    """Full attention with a per-head output gate (Qwen3-Next / 3.5: q_proj twice as wide, the
    output times sigmoid(gate); model/gated_attention.py)."""
    norm_zero_centered: bool = False
    """RMSNorm weights stored zero-centred, applied as (1 + w) (Qwen3-Next / 3.5)."""
    kv_lora_rank: int = Field(default=0, ge=0)
    """Multi-head latent attention (DeepSeek-V3, model/mla.py) when > 0: the compressed kv
    latent's width; 0: grouped-query attention."""
    q_lora_rank: int | None = Field(default=None, ge=1)
    """MLA: the low-rank q (q_a_proj -> norm -> q_b_proj) width; None: a plain q_proj."""
    qk_nope_head_dim: int = Field(default=0, ge=0)
    """MLA: the per-head q/k dims without RoPE."""
    qk_rope_head_dim: int = Field(default=0, ge=0)
    """MLA: the per-head q/k dims with RoPE (the k part shared by all heads); equals head_dim,
    the width of the model's RoPE tables."""
    v_head_dim: int = Field(default=0, ge=0)
    """MLA: the value head width (K is qk_nope + qk_rope wide)."""
    rope_interleave: bool = False
    """MLA: RoPE on (even, odd) pairs of the rope dims (DeepSeek's layout); false: rotate-half."""
    initializer_range: float = Field(default=0.02, gt=0)
    """Std of the normal init of linear/embedding/expert weights (random init only)."""
    moe_impl: MoEImpl = "grouped"
    """Expert compute path (runtime choice, not part of the checkpoint): `grouped` sorts the
    assignments by expert and runs two torch._grouped_mm calls, no host sync (where _grouped_mm
    cannot run, e.g. float32 on CUDA, a per-expert loop: a logged, recorded fallback);
    `grouped_mm` the same but an error instead of the fallback; `loop` is the slow per-expert
    reference (model/moe_block.py). Applied to a built model by its converter (model/converters.py
    `ExpertPath`, from `model_converters`); building `MoEForCausalLM` does not read it."""

    @model_validator(mode="after")
    def _layer_types(self) -> "ModelConfig":
        if self.layer_types and len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"layer_types has {len(self.layer_types)} entries, num_hidden_layers is "
                f"{self.num_hidden_layers}"
            )
        if "sliding_attention" in self.layer_types and self.sliding_window is None:
            raise ValueError(
                "layer_types names sliding_attention layers but sliding_window is unset"
            )
        linear = (self.linear_num_key_heads, self.linear_num_value_heads,
                  self.linear_key_head_dim, self.linear_value_head_dim)  # fmt: skip
        if "linear_attention" in self.layer_types and not all(linear):
            raise ValueError(
                "layer_types names linear_attention layers but linear_num_key_heads, "
                "linear_num_value_heads, linear_key_head_dim, linear_value_head_dim are not all set"
            )
        if all(linear) and self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(
                f"linear_num_value_heads={self.linear_num_value_heads} is not a multiple of "
                f"linear_num_key_heads={self.linear_num_key_heads}"
            )
        if self.kv_lora_rank and (
            self.qk_rope_head_dim != self.head_dim
            or self.num_key_value_heads != self.num_attention_heads
            or not (self.qk_nope_head_dim and self.v_head_dim)
        ):
            raise ValueError(
                f"multi-head latent attention (kv_lora_rank={self.kv_lora_rank}) needs "
                f"qk_rope_head_dim == head_dim (got {self.qk_rope_head_dim}, {self.head_dim}), "
                f"num_key_value_heads == num_attention_heads (got {self.num_key_value_heads}, "
                f"{self.num_attention_heads}) and qk_nope_head_dim, v_head_dim > 0"
            )
        return self

    def layer_window(self, layer_idx: int) -> int | None:
        """The sliding window of layer `layer_idx` (keys a query sees, itself included), None for
        a full-attention layer."""
        if self.layer_types and self.layer_types[layer_idx] == "sliding_attention":
            return self.sliding_window
        return None
