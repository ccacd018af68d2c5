"""DeepSeek-V3 / R1, Kimi K2, Moonlight (`deepseek_v3`): multi-head latent attention
(model/mla.py: `q_lora_rank` set or None, a kv latent of `kv_lora_rank` plus a shared rope key of
`qk_rope_head_dim`, K and V of different widths, interleaved RoPE, YaRN with the mscale
correction of the softmax scale), the sigmoid group-limited router of GLM-4.5
(`sigmoid_group_topk`, `e_score_correction_bias` for selection only, `routed_scaling_factor`),
an ungated shared expert of width `moe_intermediate_size * n_shared_experts`, the first
`first_k_dense_replace` layers dense. Released checkpoints store FP8 weights with 128x128
`weight_scale_inv` blocks: dequantised on load (model/fp8.py); saving writes the dequantised
weights and no `quantization_config`. MTP layers (`model.layers.{num_hidden_layers + i}.*`) are
kept and written back, not built or trained.

The model's RoPE tables are `qk_rope_head_dim` wide: `head_dim` is set to `qk_rope_head_dim`
(as transformers' DeepseekV3Config does) and every head has `num_key_value_heads ==
num_attention_heads` (MLA has no grouped heads)."""

from __future__ import annotations

from typing import Any

import torch

from slipstream.config.model import ModelConfig, YarnRope
from slipstream.model.families import (
    Family,
    StandardWeightMap,
    common_from_hf,
    common_to_hf,
    mtp_layers,
    register,
    reject,
    require,
    rope_of,
)
from slipstream.model.fp8 import (
    SCALE_SUFFIX,
    block_size_from_hf,
    dequantize_fp8_block,
    dequantize_state_dict,
    infer_block,
)
from slipstream.model.mla import yarn_mscale

_FIXED = dict(
    router_scheme="sigmoid_group_topk",
    router_bias=False,
    router_correction_bias=True,
    shared_expert_gated=False,
    attention_out_bias=False,
    qk_norm="none",
    clip_qkv=None,
    decoder_sparse_step=1,
    partial_rotary_factor=1.0,
    router_aux_loss_coef=0.0,
)


def _yarn_from_hf(rope: dict[str, Any], max_positions: int) -> YarnRope | None:
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return None
    if kind != "yarn":
        raise ValueError(f"config.json rope_type={kind!r}: deepseek_v3 reads default or yarn")
    original = rope["original_max_position_embeddings"]
    factor = rope.get("factor") or max_positions / original
    mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
    attention_factor = rope.get("attention_factor")
    if attention_factor is None:  # transformers' _compute_yarn_parameters
        if mscale and mscale_all_dim:
            attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = yarn_mscale(factor)
    return YarnRope(
        factor=factor,
        original_max_position_embeddings=original,
        beta_fast=rope.get("beta_fast") or 32.0,
        beta_slow=rope.get("beta_slow") or 1.0,
        truncate=rope.get("truncate", True),
        attention_factor=attention_factor,
        mscale=mscale,
        mscale_all_dim=mscale_all_dim,
    )


def config_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    block_size_from_hf(hf)  # FP8 blocks are dequantised on load; other methods refused here
    heads = hf["num_attention_heads"]
    if hf.get("num_key_value_heads", heads) != heads:
        raise ValueError(
            f"config.json num_key_value_heads={hf['num_key_value_heads']} must equal "
            f"num_attention_heads={heads}: MLA has no grouped heads"
        )
    reject(hf, "scoring_func", "sigmoid", "DeepSeek-V3 routing scores are sigmoid")
    reject(hf, "topk_method", "noaux_tc", "DeepSeek-V3 selects on the bias-corrected scores")
    reject(hf, "moe_layer_freq", 1, "every layer after first_k_dense_replace is MoE")
    rope = dict(rope_of(hf))
    yarn = _yarn_from_hf(rope, hf.get("max_position_embeddings", 4096))
    theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    plain = {"rope_type": "default", "rope_theta": theta}
    fields = common_from_hf({**hf, "rope_parameters": plain, "rope_scaling": None})
    moe_inter = hf["moe_intermediate_size"]
    fields.update(
        _FIXED,
        head_dim=hf["qk_rope_head_dim"],
        num_key_value_heads=heads,
        intermediate_size=hf["intermediate_size"],
        moe_intermediate_size=moe_inter,
        num_experts=hf["n_routed_experts"],
        num_experts_per_tok=hf["num_experts_per_tok"],
        norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
        n_group=hf.get("n_group") or 1,
        topk_group=hf.get("topk_group") or 1,
        routed_scaling_factor=hf.get("routed_scaling_factor", 1.0),
        shared_expert_intermediate_size=moe_inter * (hf.get("n_shared_experts") or 0),
        mlp_only_layers=list(range(hf.get("first_k_dense_replace") or 0)),
        attention_bias=bool(hf.get("attention_bias", False)),
        q_lora_rank=hf.get("q_lora_rank"),
        kv_lora_rank=hf["kv_lora_rank"],
        qk_nope_head_dim=hf["qk_nope_head_dim"],
        qk_rope_head_dim=hf["qk_rope_head_dim"],
        v_head_dim=hf["v_head_dim"],
        rope_interleave=bool(hf.get("rope_interleave", True)),
        rope_scaling=yarn,
        num_nextn_predict_layers=hf.get("num_nextn_predict_layers", 0),
    )
    return fields


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    first_dense = len(cfg.mlp_only_layers)
    require(cfg, "deepseek_v3", **_FIXED, mlp_only_layers=list(range(first_dense)))
    if cfg.kv_lora_rank <= 0:
        raise ValueError("model.kv_lora_rank must be > 0 for a deepseek_v3 checkpoint (MLA)")
    if cfg.shared_expert_intermediate_size % cfg.moe_intermediate_size:
        raise ValueError(
            f"model.shared_expert_intermediate_size={cfg.shared_expert_intermediate_size} is "
            f"not a multiple of moe_intermediate_size={cfg.moe_intermediate_size} (deepseek_v3 "
            "stores n_shared_experts)"
        )
    out = common_to_hf(cfg, DEEPSEEK_V3)
    y = cfg.rope_scaling
    if y is not None:
        out["rope_parameters"] = {
            "rope_type": "yarn", "rope_theta": cfg.rope_theta, "factor": y.factor,
            "original_max_position_embeddings": y.original_max_position_embeddings,
            "beta_fast": y.beta_fast, "beta_slow": y.beta_slow, "truncate": y.truncate,
            **({"mscale": y.mscale} if y.mscale is not None else {}),
            **({"mscale_all_dim": y.mscale_all_dim} if y.mscale_all_dim is not None else {}),
        }  # fmt: skip
        if not (y.mscale and y.mscale_all_dim):
            out["rope_parameters"]["attention_factor"] = y.attention_factor
    del out["head_dim"]  # derived from qk_rope_head_dim by transformers
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
        q_lora_rank=cfg.q_lora_rank,
        kv_lora_rank=cfg.kv_lora_rank,
        qk_nope_head_dim=cfg.qk_nope_head_dim,
        qk_rope_head_dim=cfg.qk_rope_head_dim,
        v_head_dim=cfg.v_head_dim,
        rope_interleave=cfg.rope_interleave,
        num_nextn_predict_layers=cfg.num_nextn_predict_layers,
        output_router_logits=False,
    )
    return out


class DeepseekV3WeightMap(StandardWeightMap):
    """Per-expert disk layout (as GLM), MTP layers passed through, FP8 block weights
    dequantised on load when the tensors carry `*.weight_scale_inv` (128x128 blocks, or the
    block the scale grid implies: model/fp8.py `infer_block`)."""

    def from_hf(self, sd, cfg):  # type: ignore[no-untyped-def]
        if any(k.endswith(".weight_scale_inv") for k in sd):
            # into the dtype the unquantised tensors were read in (the load's dtype)
            dtype = next(
                (t.dtype for k, t in sd.items()
                 if t.is_floating_point() and t.element_size() > 1 and not k.endswith("_inv")),
                torch.float32,
            )  # fmt: skip
            sd = dequantize_state_dict(sd, dtype=dtype)
        return super().from_hf(sd, cfg)

    def rows(self, source, name, lo, hi, cfg):  # type: ignore[no-untyped-def]
        return super().rows(_DequantisingSource(source), name, lo, hi, cfg)


class _DequantisingSource:
    """A `RowSource` whose FP8 tensors come out dequantised (the whole tensor is read, then its
    rows taken: a 128-row block's scale covers rows of several experts' slices)."""

    def __init__(self, source: Any) -> None:
        self.source = source

    def has(self, name: str) -> bool:
        return self.source.has(name)

    def slice(self, name: str, lo: int | None, hi: int | None):  # type: ignore[no-untyped-def]
        scale = name + SCALE_SUFFIX
        if not self.source.has(scale):
            return self.source.slice(name, lo, hi)
        w, s = self.source.slice(name, None, None), self.source.slice(scale, None, None)
        full = dequantize_fp8_block(w, s, infer_block(tuple(w.shape), tuple(s.shape)))
        return full[lo:hi]


def tiny_hf_config() -> dict[str, Any]:
    return {
        "model_type": "deepseek_v3", "vocab_size": 96, "hidden_size": 32,
        "intermediate_size": 48, "moe_intermediate_size": 16, "num_hidden_layers": 3,
        "num_attention_heads": 4, "num_key_value_heads": 4, "n_routed_experts": 8,
        "num_experts_per_tok": 3, "n_shared_experts": 2, "n_group": 4, "topk_group": 2,
        "routed_scaling_factor": 2.5, "first_k_dense_replace": 1, "norm_topk_prob": True,
        "q_lora_rank": 24, "kv_lora_rank": 16, "qk_nope_head_dim": 12, "qk_rope_head_dim": 8,
        "v_head_dim": 10, "rope_interleave": True, "attention_bias": False,
        "max_position_embeddings": 256,
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                            "original_max_position_embeddings": 64, "mscale": 0.9,
                            "mscale_all_dim": 0.7, "beta_fast": 32, "beta_slow": 1},
    }  # fmt: skip


DEEPSEEK_V3 = register(
    Family(
        model_type="deepseek_v3",
        architectures=("DeepseekV3ForCausalLM",),
        config_from_hf=config_from_hf,
        config_to_hf=config_to_hf,
        weights=DeepseekV3WeightMap(passthrough=mtp_layers),
        tiny_hf_config=tiny_hf_config,
        summary="DeepSeek-V3/R1, Kimi K2, Moonlight: MLA (q_lora_rank set or not, YaRN mscale, "
        "interleaved RoPE), sigmoid group-limited routing with correction bias, ungated shared "
        "experts, first_k_dense_replace; FP8 128x128 blocks dequantised on load; MTP passed "
        "through",
    )
)
