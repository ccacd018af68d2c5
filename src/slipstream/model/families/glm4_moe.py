"""GLM-4.5 / 4.6 / 4.7 (`glm4_moe`): the DeepSeek-V3 sigmoid router (`sigmoid_group_topk`:
selection on sigmoid(logits) + `e_score_correction_bias` within the best `topk_group` of
`n_group` groups, weights from the unbiased scores, renormalised, x `routed_scaling_factor`;
router in float32), an ungated shared expert of width `moe_intermediate_size * n_shared_experts`
(`mlp.shared_experts`), the first `first_k_dense_replace` layers dense (`intermediate_size`),
q/k/v biases (`attention_bias`; o_proj none), optional per-head q/k norm (`use_qk_norm`),
partial rotary (`partial_rotary_factor`, default 0.5). The checkpoint's MTP layers
(`model.layers.{num_hidden_layers + i}.*`, `num_nextn_predict_layers`) are kept and written back,
not built or trained. The correction bias is a buffer: saved, pushed with the weights, frozen."""

from __future__ import annotations

from typing import Any

from slipstream.config.model import ModelConfig
from slipstream.model.families import (
    Family,
    StandardWeightMap,
    common_from_hf,
    common_to_hf,
    mtp_layers,
    register,
    require,
    rope_of,
)

_FIXED = dict(
    router_scheme="sigmoid_group_topk",
    router_bias=False,
    router_correction_bias=True,
    shared_expert_gated=False,
    attention_out_bias=False,
    clip_qkv=None,
    decoder_sparse_step=1,
    router_aux_loss_coef=0.0,
)


def config_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    fields = common_from_hf(hf)
    rope = rope_of(hf)
    partial = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.5))
    moe_inter = hf["moe_intermediate_size"]
    fields.update(
        _FIXED,
        intermediate_size=hf["intermediate_size"],
        moe_intermediate_size=moe_inter,
        num_experts=hf["n_routed_experts"],
        num_experts_per_tok=hf["num_experts_per_tok"],
        norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
        n_group=hf.get("n_group", 1),
        topk_group=hf.get("topk_group", 1),
        routed_scaling_factor=hf.get("routed_scaling_factor", 1.0),
        shared_expert_intermediate_size=moe_inter * hf.get("n_shared_experts", 1),
        mlp_only_layers=list(range(hf.get("first_k_dense_replace", 1))),
        attention_bias=bool(hf.get("attention_bias", False)),
        qk_norm="per_head" if hf.get("use_qk_norm", False) else "none",
        partial_rotary_factor=partial,
        num_nextn_predict_layers=hf.get("num_nextn_predict_layers", 0),
    )
    return fields


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    first_dense = len(cfg.mlp_only_layers)
    require(cfg, "glm4_moe", **_FIXED, mlp_only_layers=list(range(first_dense)))
    if cfg.qk_norm == "full":
        raise ValueError("model.qk_norm='full' cannot be saved as a glm4_moe checkpoint")
    if cfg.shared_expert_intermediate_size % cfg.moe_intermediate_size:
        raise ValueError(
            f"model.shared_expert_intermediate_size={cfg.shared_expert_intermediate_size} is "
            f"not a multiple of moe_intermediate_size={cfg.moe_intermediate_size} (glm4_moe "
            "stores n_shared_experts)"
        )
    out = common_to_hf(cfg, GLM4_MOE, partial_rotary_factor=cfg.partial_rotary_factor)
    out.update(
        intermediate_size=cfg.intermediate_size,
        moe_intermediate_size=cfg.moe_intermediate_size,
        n_routed_experts=cfg.num_experts,
        num_experts_per_tok=cfg.num_experts_per_tok,
        n_shared_experts=cfg.shared_expert_intermediate_size // cfg.moe_intermediate_size,
        norm_topk_prob=cfg.norm_topk_prob,
        n_group=cfg.n_group,
        topk_group=cfg.topk_group,
        routed_scaling_factor=cfg.routed_scaling_factor,
        first_k_dense_replace=first_dense,
        attention_bias=cfg.attention_bias,
        use_qk_norm=cfg.qk_norm == "per_head",
        num_nextn_predict_layers=cfg.num_nextn_predict_layers,
        output_router_logits=False,
    )
    return out


def tiny_hf_config() -> dict[str, Any]:
    return {
        "model_type": "glm4_moe", "vocab_size": 96, "hidden_size": 32, "intermediate_size": 48,
        "moe_intermediate_size": 16, "num_hidden_layers": 3, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 8, "n_routed_experts": 8,
        "num_experts_per_tok": 3, "n_shared_experts": 2, "n_group": 4, "topk_group": 2,
        "routed_scaling_factor": 2.5, "first_k_dense_replace": 1, "norm_topk_prob": True,
        "attention_bias": True, "use_qk_norm": True, "num_nextn_predict_layers": 0,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                            "partial_rotary_factor": 0.5},
    }  # fmt: skip


GLM4_MOE = register(
    Family(
        model_type="glm4_moe",
        architectures=("Glm4MoeForCausalLM",),
        config_from_hf=config_from_hf,
        config_to_hf=config_to_hf,
        weights=StandardWeightMap(passthrough=mtp_layers),
        tiny_hf_config=tiny_hf_config,
        summary="GLM-4.5/4.6/4.7: sigmoid group-limited routing with correction bias and "
        "scaling, ungated shared experts, first_k_dense_replace, q/k/v biases, optional "
        "per-head q/k norm, partial rotary; MTP layers passed through",
    )
)
