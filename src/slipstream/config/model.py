"""`[model]`: the MoE policy architecture. Field names match Hugging Face `Qwen3MoeConfig` so the
section maps one-to-one onto a checkpoint's `config.json`."""

from typing import Literal, get_args

from pydantic import Field

from slipstream.config.base import Section

MoEImpl = Literal["grouped", "grouped_mm", "loop"]
"""The expert compute paths `model.moe_impl` may name (model/moe_block.py implements each)."""
MOE_IMPLS: tuple[str, ...] = get_args(MoEImpl)
"""The same list as a tuple (validation messages, benchmarks): one list, not a second copy."""


class ModelConfig(Section):
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
    initializer_range: float = Field(default=0.02, gt=0)
    """Std of the normal init of linear/embedding/expert weights (random init only)."""
    moe_impl: MoEImpl = "grouped"
    """Expert compute path (runtime choice, not part of the checkpoint): `grouped` sorts the
    assignments by expert and runs two torch._grouped_mm calls, no host sync (where _grouped_mm
    cannot run, e.g. float32 on CUDA, a per-expert loop: a logged, recorded fallback);
    `grouped_mm` the same but an error instead of the fallback; `loop` is the slow per-expert
    reference (model/moe_block.py). Applied to a built model by its converter (model/converters.py
    `ExpertPath`, from `model_converters`); building `MoEForCausalLM` does not read it."""
