"""Qwen3-MoE (`qwen3_moe`) and dense Qwen3 (`qwen3`, loaded as a model whose layers are all
dense): softmax top-k routing (`norm_topk_prob` optional), per-head q/k RMSNorm, default RoPE,
no biases; `mlp_only_layers` / `decoder_sparse_step` pick the dense layers. A shared expert
(Qwen2-MoE style, sigmoid-gated) and `router_z_loss_coef` are written as extra config keys that
transformers' Qwen3-MoE ignores (such checkpoints round-trip through slipstream only)."""

from __future__ import annotations

from typing import Any

from slipstream.config.model import ModelConfig
from slipstream.model.families import (
    Family,
    StandardWeightMap,
    common_from_hf,
    common_to_hf,
    register,
    reject,
    require,
)

_MOE_FIELDS = (
    "intermediate_size moe_intermediate_size num_experts num_experts_per_tok norm_topk_prob "
    "decoder_sparse_step mlp_only_layers shared_expert_intermediate_size router_aux_loss_coef "
    "router_z_loss_coef"
).split()
_QWEN3_ONLY = dict(
    router_scheme="softmax_topk",
    router_bias=False,
    router_correction_bias=False,
    shared_expert_gated=True,
    attention_bias=False,
    attention_out_bias=False,
    qk_norm="per_head",
    clip_qkv=None,
    partial_rotary_factor=1.0,
)


def _reject_qwen3(hf: dict[str, Any]) -> None:
    reject(hf, "attention_bias", False, "q/k/v/o projections have no bias in Qwen3")
    reject(hf, "use_sliding_window", False, "Qwen3 sliding-window attention is not implemented")


def config_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    _reject_qwen3(hf)
    fields = common_from_hf(hf)
    fields.update({k: hf[k] for k in _MOE_FIELDS if hf.get(k) is not None})
    if "num_experts" not in fields and hf.get("num_local_experts") is not None:
        fields["num_experts"] = hf["num_local_experts"]
    return fields


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """config.json readable by transformers 4.x and 5.x `Qwen3MoeConfig` (both `num_experts`
    and `num_local_experts`, both `rope_theta` and `rope_parameters`)."""
    require(cfg, "qwen3_moe", **_QWEN3_ONLY)
    out = common_to_hf(cfg, QWEN3_MOE)
    out.update(
        attention_bias=False,
        use_sliding_window=False,
        sliding_window=None,
        num_local_experts=cfg.num_experts,
    )
    out.update({k: getattr(cfg, k) for k in _MOE_FIELDS})
    if cfg.shared_expert_intermediate_size == 0:
        del out["shared_expert_intermediate_size"]
    return out


def tiny_hf_config() -> dict[str, Any]:
    return {
        "model_type": "qwen3_moe", "vocab_size": 96, "hidden_size": 32, "intermediate_size": 48,
        "moe_intermediate_size": 16, "num_hidden_layers": 3, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 8, "num_experts": 8, "num_experts_per_tok": 2,
        "norm_topk_prob": False, "mlp_only_layers": [0], "decoder_sparse_step": 1,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    }  # fmt: skip


def qwen3_config_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """Dense Qwen3: every layer in mlp_only_layers (one unused expert of the dense width)."""
    _reject_qwen3(hf)
    fields = common_from_hf(hf)
    fields.update(
        intermediate_size=hf["intermediate_size"],
        num_experts=1,
        num_experts_per_tok=1,
        moe_intermediate_size=hf["intermediate_size"],
        mlp_only_layers=list(range(hf["num_hidden_layers"])),
    )
    return fields


def qwen3_tiny_hf_config() -> dict[str, Any]:
    return {
        "model_type": "qwen3", "vocab_size": 96, "hidden_size": 32, "intermediate_size": 48,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 8, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    }  # fmt: skip


QWEN3_MOE = register(
    Family(
        model_type="qwen3_moe",
        architectures=("Qwen3MoeForCausalLM",),
        config_from_hf=config_from_hf,
        config_to_hf=config_to_hf,
        weights=StandardWeightMap(),
        tiny_hf_config=tiny_hf_config,
        summary="Qwen3-MoE: softmax top-k (norm_topk_prob optional), per-head q/k norm, "
        "dense layers by mlp_only_layers / decoder_sparse_step, optional gated shared expert",
    )
)
QWEN3 = register(
    Family(
        model_type="qwen3",
        architectures=("Qwen3ForCausalLM",),
        config_from_hf=qwen3_config_from_hf,
        # saved as a Qwen3-MoE checkpoint whose layers are all dense (what slipstream wrote
        # before families existed; transformers loads it as Qwen3MoeForCausalLM)
        config_to_hf=config_to_hf,
        weights=StandardWeightMap(),
        tiny_hf_config=qwen3_tiny_hf_config,
        summary="dense Qwen3, loaded as a model whose layers are all dense (saved as qwen3_moe)",
    )
)
