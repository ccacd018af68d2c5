"""OLMoE (`olmoe`): softmax top-k, not renormalised by default (`norm_topk_prob = false`: the k
weights sum to less than 1); q/k RMSNorm over the whole projection (weights (H*Dh,), (K*Dh,)),
then `clip_qkv` (clamp q, k, v); `attention_bias` puts biases on q/k/v *and* o; every layer MoE;
`intermediate_size` is the expert width. Checkpoint names as transformers 5 (per-expert on
disk, like Qwen3-MoE)."""

from __future__ import annotations

from typing import Any

from slipstream.config.model import ModelConfig
from slipstream.model.families import (
    Family,
    StandardWeightMap,
    common_from_hf,
    common_to_hf,
    register,
    require,
)

_FIXED = dict(
    router_scheme="softmax_topk",
    router_bias=False,
    router_correction_bias=False,
    shared_expert_intermediate_size=0,
    qk_norm="full",
    partial_rotary_factor=1.0,
    decoder_sparse_step=1,
    mlp_only_layers=[],
)


def config_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    fields = common_from_hf(hf)
    bias = bool(hf.get("attention_bias", False))
    fields.update(
        _FIXED,
        intermediate_size=hf["intermediate_size"],
        moe_intermediate_size=hf["intermediate_size"],
        num_experts=hf["num_experts"],
        num_experts_per_tok=hf["num_experts_per_tok"],
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        attention_bias=bias,
        attention_out_bias=bias,
        clip_qkv=hf.get("clip_qkv"),
    )
    if hf.get("router_aux_loss_coef") is not None:
        fields["router_aux_loss_coef"] = hf["router_aux_loss_coef"]
    return fields


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    # intermediate_size: unused (no dense layer); OLMoE's is the expert width
    require(cfg, "olmoe", **_FIXED, attention_out_bias=cfg.attention_bias)
    out = common_to_hf(cfg, OLMOE)
    out.update(
        intermediate_size=cfg.moe_intermediate_size,
        num_experts=cfg.num_experts,
        num_experts_per_tok=cfg.num_experts_per_tok,
        norm_topk_prob=cfg.norm_topk_prob,
        attention_bias=cfg.attention_bias,
        clip_qkv=cfg.clip_qkv,
        router_aux_loss_coef=cfg.router_aux_loss_coef,
        output_router_logits=False,
    )
    return out


def tiny_hf_config() -> dict[str, Any]:
    return {
        "model_type": "olmoe", "vocab_size": 96, "hidden_size": 32, "intermediate_size": 16,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
        "num_experts": 8, "num_experts_per_tok": 3, "norm_topk_prob": False, "clip_qkv": 0.3,
        "attention_bias": True, "pad_token_id": 1, "eos_token_id": 2,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    }  # fmt: skip


OLMOE = register(
    Family(
        model_type="olmoe",
        architectures=("OlmoeForCausalLM",),
        config_from_hf=config_from_hf,
        config_to_hf=config_to_hf,
        weights=StandardWeightMap(),
        tiny_hf_config=tiny_hf_config,
        summary="OLMoE: softmax top-k (norm_topk_prob false), full-width q/k norm, clip_qkv, "
        "q/k/v/o biases",
    )
)
