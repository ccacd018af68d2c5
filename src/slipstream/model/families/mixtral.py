"""Mixtral (`mixtral`): softmax top-k always renormalised, no q/k norm, no biases, every layer
MoE; `intermediate_size` is the expert width. On disk: `block_sparse_moe.gate.weight` and
`block_sparse_moe.experts.{e}.w1/w3/w2.weight` (gate/up/down); in memory (transformers 5 and
here) `mlp.gate.weight`, `mlp.experts.gate_up_proj`/`down_proj`.

`sliding_window` (null in the released 8x7B/8x22B) windows every layer (`layer_types` all
`sliding_attention`). Not covered: `router_jitter_noise` (training-time noise, refused when
non-zero)."""

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

_FIXED = dict(
    router_scheme="softmax_topk",
    norm_topk_prob=True,
    router_bias=False,
    router_correction_bias=False,
    shared_expert_intermediate_size=0,
    attention_bias=False,
    attention_out_bias=False,
    qk_norm="none",
    clip_qkv=None,
    partial_rotary_factor=1.0,
    decoder_sparse_step=1,
    mlp_only_layers=[],
)


def config_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    reject(hf, "router_jitter_noise", 0.0, "router jitter noise would make routing random")
    fields = common_from_hf(hf)
    if hf.get("sliding_window") is not None:  # every layer windowed (Mistral-style)
        layers = hf["num_hidden_layers"]
        fields.update(sliding_window=hf["sliding_window"],
                      layer_types=["sliding_attention"] * layers)  # fmt: skip
    fields.update(
        _FIXED,
        intermediate_size=hf["intermediate_size"],
        moe_intermediate_size=hf["intermediate_size"],
        num_experts=hf["num_local_experts"],
        num_experts_per_tok=hf["num_experts_per_tok"],
    )
    if hf.get("router_aux_loss_coef") is not None:
        fields["router_aux_loss_coef"] = hf["router_aux_loss_coef"]
    return fields


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    require(cfg, "mixtral", **_FIXED)  # intermediate_size: unused (no dense layer)
    windowed = cfg.sliding_window is not None and bool(cfg.layer_types)
    if cfg.layer_types and set(cfg.layer_types) != {"sliding_attention"}:
        raise ValueError(
            f"model.layer_types={cfg.layer_types} cannot be saved as a mixtral checkpoint (its "
            "sliding_window covers every layer or none)"
        )
    out = common_to_hf(cfg, MIXTRAL)
    out.update(
        intermediate_size=cfg.moe_intermediate_size,
        num_local_experts=cfg.num_experts,
        num_experts_per_tok=cfg.num_experts_per_tok,
        router_aux_loss_coef=cfg.router_aux_loss_coef,
        router_jitter_noise=0.0,
        sliding_window=cfg.sliding_window if windowed else None,
        output_router_logits=False,
    )
    return out


def tiny_hf_config() -> dict[str, Any]:
    return {
        "model_type": "mixtral", "vocab_size": 96, "hidden_size": 32, "intermediate_size": 16,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 8, "num_local_experts": 8, "num_experts_per_tok": 2, "sliding_window": 5,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    }  # fmt: skip


MIXTRAL = register(
    Family(
        model_type="mixtral",
        architectures=("MixtralForCausalLM",),
        config_from_hf=config_from_hf,
        config_to_hf=config_to_hf,
        weights=StandardWeightMap(
            renames=((".mlp.", ".block_sparse_moe."),), expert_projs=("w1", "w3", "w2")
        ),
        tiny_hf_config=tiny_hf_config,
        summary="Mixtral: renormalised softmax top-k, no q/k norm, block_sparse_moe w1/w3/w2 "
        "on disk, optional sliding window on every layer",
    )
)
