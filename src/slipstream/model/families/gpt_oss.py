"""GPT-OSS (`gpt_oss`, gpt-oss-20b / 120b): top-k of the biased router logits then softmax over
the k (`topk_softmax`); experts with biases and the clamped SwiGLU (`swiglu_alpha`,
`swiglu_limit`); attention with q/k/v/o biases, no q/k norm, a learned sink per head, sliding-
window layers alternating with full ones (`layer_types`, `sliding_window`); YaRN RoPE; RMSNorm
with the weight multiplied in float32.

Checkpoint layout (transformers 5 writes and reads it fused, on disk as in memory):
`mlp.router.{weight,bias}` (here `mlp.gate.*`), `mlp.experts.gate_up_proj` (E, D, 2I) with gate
and up interleaved (gate `[..., ::2]`, up `[..., 1::2]`), `gate_up_proj_bias` (E, 2I)
interleaved the same way, `down_proj` (E, I, D), `down_proj_bias` (E, D): x @ W, where the
internal layout is x @ W^T with the gate rows first (model/moe_block.py `Experts`). The map
transposes and de-interleaves on load, and back on save. Released checkpoints store the expert
projections as MXFP4 (`gate_up_proj_blocks` / `_scales`, `down_proj_blocks` / `_scales`,
model/mxfp4.py): dequantised on load (equal to transformers' own dequantisation); saved back as
dequantised weights (transformers loads those without a quantization_config).
"""

from __future__ import annotations

from typing import Any

import torch

from slipstream.config.model import ModelConfig, YarnRope
from slipstream.model import mxfp4
from slipstream.model.families import (
    Family,
    common_from_hf,
    common_to_hf,
    register,
    require,
    rope_of,
)

_FIXED = dict(
    router_scheme="topk_softmax",
    router_bias=True,
    router_correction_bias=False,
    shared_expert_intermediate_size=0,
    qk_norm="none",
    clip_qkv=None,
    partial_rotary_factor=1.0,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    attention_sinks=True,
    norm_weight_in_float32=True,
    expert_bias=True,
    expert_activation="clamped_swiglu",
)
_EXPERTS = ".mlp.experts."


def config_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    if hf.get("quantization_config") not in (None, {}) and (
        hf["quantization_config"].get("quant_method") != "mxfp4"
    ):
        raise ValueError(
            f"config.json quantization_config={hf['quantization_config']!r}: only MXFP4 experts "
            "(dequantised on load) are implemented"
        )
    rope = dict(rope_of(hf))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    yarn = None
    if rope_type == "yarn":
        yarn = YarnRope(
            factor=rope["factor"],
            original_max_position_embeddings=rope["original_max_position_embeddings"],
            beta_fast=rope.get("beta_fast") or 32.0,
            beta_slow=rope.get("beta_slow") or 1.0,
            truncate=rope.get("truncate", True),
            attention_factor=rope.get("attention_factor"),
        )
        if rope.get("mscale") or rope.get("mscale_all_dim"):
            raise ValueError(f"config.json rope {rope!r}: YaRN mscale is not implemented")
    elif rope_type != "default":
        raise ValueError(f"config.json rope {rope!r}: gpt_oss reads yarn or default RoPE")
    plain = {k: v for k, v in hf.items() if k not in ("rope_parameters", "rope_scaling")}
    plain["rope_parameters"] = {"rope_type": "default", "rope_theta": rope.get("rope_theta",
                                hf.get("rope_theta", 150000.0))}  # fmt: skip
    fields = common_from_hf(plain)
    layer_types = hf.get("layer_types") or [
        "sliding_attention" if (i + 1) % 2 else "full_attention"
        for i in range(hf["num_hidden_layers"])
    ]  # transformers' default when config.json has none
    bias = bool(hf.get("attention_bias", True))
    fields.update(
        _FIXED,
        intermediate_size=hf["intermediate_size"],
        moe_intermediate_size=hf["intermediate_size"],
        num_experts=hf["num_local_experts"],
        num_experts_per_tok=hf["num_experts_per_tok"],
        attention_bias=bias,
        attention_out_bias=bias,
        sliding_window=hf.get("sliding_window"),
        layer_types=layer_types,
        rope_scaling=yarn,
        swiglu_alpha=hf.get("swiglu_alpha", 1.702),
        swiglu_limit=hf.get("swiglu_limit", 7.0),
    )
    if hf.get("router_aux_loss_coef") is not None:
        fields["router_aux_loss_coef"] = hf["router_aux_loss_coef"]
    return fields


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    require(cfg, "gpt_oss", **_FIXED, intermediate_size=cfg.moe_intermediate_size,
            attention_out_bias=cfg.attention_bias)  # fmt: skip
    out = common_to_hf(cfg, GPT_OSS)
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling is not None:
        y = cfg.rope_scaling
        rope = {"rope_type": "yarn", "rope_theta": cfg.rope_theta, "factor": y.factor,
                "original_max_position_embeddings": y.original_max_position_embeddings,
                "beta_fast": y.beta_fast, "beta_slow": y.beta_slow, "truncate": y.truncate}  # fmt: skip
        if y.attention_factor is not None:
            rope["attention_factor"] = y.attention_factor
    out.update(
        intermediate_size=cfg.moe_intermediate_size,
        num_local_experts=cfg.num_experts,
        num_experts_per_tok=cfg.num_experts_per_tok,
        attention_bias=cfg.attention_bias,
        sliding_window=cfg.sliding_window,
        layer_types=list(cfg.layer_types) or ["full_attention"] * cfg.num_hidden_layers,
        swiglu_alpha=cfg.swiglu_alpha,
        swiglu_limit=cfg.swiglu_limit,
        router_aux_loss_coef=cfg.router_aux_loss_coef,
        output_router_logits=False,
        rope_parameters=rope,
    )
    return out


def tiny_hf_config() -> dict[str, Any]:
    """Every feature on: biases (randomise them: transformers zeroes expert biases), sinks,
    sliding window 4 on layer 0 (tests run T > 8), YaRN as released, a small swiglu_limit so the
    clamps bite at random-init activations."""
    return {
        "model_type": "gpt_oss", "vocab_size": 96, "hidden_size": 32, "intermediate_size": 16,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 8, "num_local_experts": 8, "num_experts_per_tok": 2, "sliding_window": 4,
        "layer_types": ["sliding_attention", "full_attention"], "swiglu_limit": 0.05,
        "max_position_embeddings": 4096,
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
                            "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                            "original_max_position_embeddings": 4096},
    }  # fmt: skip


# ---- weights --------------------------------------------------------------------------------


def _interleave(gate_up_E2I_: torch.Tensor) -> torch.Tensor:
    """(E, 2I, ...) gate rows then up rows -> rows alternating gate, up."""
    E, I2 = gate_up_E2I_.shape[:2]
    gate, up = gate_up_E2I_.chunk(2, dim=1)
    return torch.stack((gate, up), dim=2).reshape(E, I2, *gate_up_E2I_.shape[2:])


def _deinterleave(gate_up_E2I_: torch.Tensor) -> torch.Tensor:
    """Rows alternating gate, up -> gate rows then up rows (a copy)."""
    return torch.cat((gate_up_E2I_[:, 0::2], gate_up_E2I_[:, 1::2]), dim=1)


def _disk(name: str) -> str:
    return name.replace(".mlp.gate.", ".mlp.router.")


def _memory(name: str) -> str:
    return name.replace(".mlp.router.", ".mlp.gate.")


def _expert_to_hf(name: str, t: torch.Tensor) -> torch.Tensor:
    """One internal expert tensor in transformers' layout."""
    if name.endswith("gate_up_proj"):  # (E, 2I, D) -> (E, D, 2I) interleaved
        return _interleave(t).transpose(1, 2)
    if name.endswith("gate_up_proj_bias"):
        return _interleave(t)
    if name.endswith("down_proj"):  # (E, D, I) -> (E, I, D)
        return t.transpose(1, 2)
    return t  # down_proj_bias (E, D)


def _expert_from_hf(name: str, t: torch.Tensor) -> torch.Tensor:
    if name.endswith("gate_up_proj"):
        return _deinterleave(t.transpose(1, 2)).contiguous()
    if name.endswith("gate_up_proj_bias"):
        return _deinterleave(t).contiguous()
    if name.endswith("down_proj"):
        return t.transpose(1, 2).contiguous()
    return t


def _dequantized_from_hf(name: str, t: torch.Tensor) -> torch.Tensor:
    """A dequantised MXFP4 projection (E, out, in) -> internal layout."""
    return _deinterleave(t).contiguous() if name.endswith("gate_up_proj") else t.contiguous()


class GptOssWeightMap:
    """See the module docstring; on disk as in memory (`fused_experts` changes nothing)."""

    def to_hf(self, sd, cfg, fused_experts):  # type: ignore[no-untyped-def]
        out: dict[str, torch.Tensor] = {}
        for name, t in sd.items():
            if name == "lm_head.weight" and cfg.tie_word_embeddings:
                continue
            out[_disk(name)] = _expert_to_hf(name, t) if _EXPERTS in name else t
        return out

    def from_hf(self, sd, cfg):  # type: ignore[no-untyped-def]
        quantized = any(mxfp4.is_quantized_name(n) for n in sd)
        if quantized:
            dtype = next(t.dtype for t in sd.values() if t.is_floating_point())
            sd = mxfp4.dequantize_state_dict(sd, dtype)
        out: dict[str, torch.Tensor] = {}
        for name, t in sd.items():
            if name.endswith(".mxfp4_dequantized"):
                base = name.removesuffix(".mxfp4_dequantized")
                out[_memory(base)] = _dequantized_from_hf(base, t)
            elif _EXPERTS in name:
                out[_memory(name)] = _expert_from_hf(name, t)
            else:
                out[_memory(name)] = t
        return out, {}

    def rows(self, source, name, lo, hi, cfg):  # type: ignore[no-untyped-def]
        disk = _disk(name)
        if _EXPERTS in name:
            if not source.has(disk) and source.has(f"{disk}_blocks"):
                t = mxfp4.dequantize(source.slice(f"{disk}_blocks", lo, hi),
                                     source.slice(f"{disk}_scales", lo, hi))  # fmt: skip
                return _dequantized_from_hf(name, t)
            return _expert_from_hf(name, source.slice(disk, lo, hi))
        return source.slice(disk, lo, hi)


GPT_OSS = register(
    Family(
        model_type="gpt_oss",
        architectures=("GptOssForCausalLM",),
        config_from_hf=config_from_hf,
        config_to_hf=config_to_hf,
        weights=GptOssWeightMap(),
        tiny_hf_config=tiny_hf_config,
        summary="GPT-OSS: biased top-k-then-softmax router, biased clamped-SwiGLU experts, "
        "q/k/v/o biases, attention sinks, sliding-window layers, YaRN; MXFP4 experts "
        "dequantised on load",
    )
)
