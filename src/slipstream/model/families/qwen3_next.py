"""Qwen3-Next (`qwen3_next`): the hybrid of Gated DeltaNet (linear-attention) layers and gated
full-attention layers (`layer_types`: three `linear_attention` per `full_attention` in the
releases), zero-centred RMSNorms (`1 + w`), partial rotary (`partial_rotary_factor` 0.25),
softmax top-k routing (Qwen3-MoE's) with a sigmoid-gated shared expert (Qwen2-MoE's).

Blocks: model/gated_deltanet.py (`GatedDeltaNet`, `ZeroCenteredRMSNorm`), model/gated_attention.py
(`GatedAttention`). The model's GDN parameters use Qwen3.5's split names (`in_proj_qkv`,
`in_proj_z`, `in_proj_b`, `in_proj_a`); this family's checkpoints fuse them per key head into
`in_proj_qkvz` and `in_proj_ba`, which the weight map splits on load and fuses on save (the one
exception to "internal names are transformers' in-memory names"). `mtp.*` tensors (the
multi-token-prediction head) are kept and written back, not built or trained.

Qwen3.5 / 3.6 (`qwen3_5_moe_text`, `qwen3_5_moe`) share this architecture: model/families/
qwen3_5_moe.py reads them with the helpers below."""

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
    rope_of,
)
from slipstream.model.gated_deltanet import (
    fuse_qwen3_next_projections,
    split_qwen3_next_projections,
)

HYBRID_FIXED = dict(
    router_scheme="softmax_topk",
    router_bias=False,
    router_correction_bias=False,
    shared_expert_gated=True,
    qk_norm="per_head",
    clip_qkv=None,
    attention_output_gate=True,
    norm_zero_centered=True,
    kv_lora_rank=0,
)
"""What every Qwen3-Next / 3.5 / 3.6 checkpoint fixes."""
LINEAR_FIELDS = (
    "linear_num_key_heads linear_num_value_heads linear_key_head_dim linear_value_head_dim "
    "linear_conv_kernel_dim"
).split()


def mtp_keys(name: str, cfg: ModelConfig) -> bool:
    """Qwen3-Next / 3.5's multi-token-prediction head (`mtp.*`): kept, not built."""
    return name.startswith("mtp.")


def hybrid_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """The fields Qwen3-Next and Qwen3.5 read alike (text config)."""
    rope = rope_of(hf)
    fields = common_from_hf(hf)
    n = hf["num_hidden_layers"]
    layer_types = hf.get("layer_types")
    if layer_types is None:  # transformers' default: every `full_attention_interval`-th layer
        interval = hf.get("full_attention_interval", 4)
        layer_types = [
            "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n)
        ]
    for kind in set(layer_types) - {"full_attention", "linear_attention"}:
        raise ValueError(f"config.json layer_types holds {kind!r}; expected full/linear_attention")
    fields.update(
        HYBRID_FIXED,
        layer_types=list(layer_types),
        partial_rotary_factor=rope.get(
            "partial_rotary_factor", hf.get("partial_rotary_factor", 0.25)
        ),
        attention_bias=bool(hf.get("attention_bias", False)),
        attention_out_bias=bool(hf.get("attention_bias", False)),
        moe_intermediate_size=hf["moe_intermediate_size"],
        num_experts=hf["num_experts"],
        num_experts_per_tok=hf["num_experts_per_tok"],
        shared_expert_intermediate_size=hf.get("shared_expert_intermediate_size") or 0,
        router_aux_loss_coef=hf.get("router_aux_loss_coef", 0.001),
        **{k: hf[k] for k in LINEAR_FIELDS if hf.get(k) is not None},
    )
    return fields


def hybrid_to_hf(cfg: ModelConfig, family: Family) -> dict[str, Any]:
    require(cfg, family.model_type, **HYBRID_FIXED, attention_out_bias=cfg.attention_bias)
    out = common_to_hf(cfg, family, partial_rotary_factor=cfg.partial_rotary_factor)
    out.update(
        layer_types=list(cfg.layer_types),
        attention_bias=cfg.attention_bias,
        moe_intermediate_size=cfg.moe_intermediate_size,
        num_experts=cfg.num_experts,
        num_experts_per_tok=cfg.num_experts_per_tok,
        shared_expert_intermediate_size=cfg.shared_expert_intermediate_size,
        router_aux_loss_coef=cfg.router_aux_loss_coef,
        output_router_logits=False,
        **{k: getattr(cfg, k) for k in LINEAR_FIELDS},
    )
    return out


def config_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    fields = hybrid_from_hf(hf)
    fields.update(
        intermediate_size=hf.get("intermediate_size", fields["moe_intermediate_size"]),
        norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
        decoder_sparse_step=hf.get("decoder_sparse_step", 1),
        mlp_only_layers=list(hf.get("mlp_only_layers") or []),
    )
    return fields


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    out = hybrid_to_hf(cfg, QWEN3_NEXT)
    out.update(
        intermediate_size=cfg.intermediate_size,
        norm_topk_prob=cfg.norm_topk_prob,
        decoder_sparse_step=cfg.decoder_sparse_step,
        mlp_only_layers=list(cfg.mlp_only_layers),
    )
    return out


_SPLIT = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")


def _dims(cfg: ModelConfig) -> tuple[int, int, int, int]:
    return (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
            cfg.linear_value_head_dim)  # fmt: skip


class Qwen3NextWeightMap(StandardWeightMap):
    """Per-expert experts (as Qwen3-MoE), `mtp.*` passed through, and the GDN input projections
    fused per key head on disk (and in transformers' memory) as `in_proj_qkvz` / `in_proj_ba`."""

    def to_hf(self, sd, cfg, fused_experts):  # type: ignore[no-untyped-def]
        out = super().to_hf(sd, cfg, fused_experts)
        for name in [k for k in out if k.endswith(".linear_attn.in_proj_qkv.weight")]:
            prefix = name.removesuffix("in_proj_qkv.weight")
            parts = {p: out.pop(f"{prefix}{p}.weight") for p in _SPLIT}
            qkvz, ba = fuse_qwen3_next_projections(parts, *_dims(cfg))
            out[f"{prefix}in_proj_qkvz.weight"], out[f"{prefix}in_proj_ba.weight"] = qkvz, ba
        return out

    def from_hf(self, sd, cfg):  # type: ignore[no-untyped-def]
        sd = dict(sd)
        for name in [k for k in sd if k.endswith(".linear_attn.in_proj_qkvz.weight")]:
            prefix = name.removesuffix("in_proj_qkvz.weight")
            ba = sd.pop(f"{prefix}in_proj_ba.weight", None)
            if ba is None:
                raise ValueError(f"checkpoint has {name} but no {prefix}in_proj_ba.weight")
            parts = split_qwen3_next_projections(sd.pop(name), ba, *_dims(cfg))
            sd.update({f"{prefix}{p}.weight": t for p, t in parts.items()})
        return super().from_hf(sd, cfg)

    def rows(self, source, name, lo, hi, cfg):  # type: ignore[no-untyped-def]
        prefix, _, leaf = name.rpartition(".linear_attn.")
        if leaf.removesuffix(".weight") in _SPLIT and not source.has(name):
            base = f"{prefix}.linear_attn."
            parts = split_qwen3_next_projections(
                source.slice(f"{base}in_proj_qkvz.weight", None, None),
                source.slice(f"{base}in_proj_ba.weight", None, None),
                *_dims(cfg),
            )
            return parts[leaf.removesuffix(".weight")][lo:hi]
        return super().rows(source, name, lo, hi, cfg)


def tiny_hf_config() -> dict[str, Any]:
    """Every feature on: GDN with grouped value heads (4 value heads per 2 key heads), layers of
    both kinds, a dense layer, a shared expert, partial rotary."""
    return {
        "model_type": "qwen3_next", "vocab_size": 96, "hidden_size": 32,
        "intermediate_size": 48, "moe_intermediate_size": 16, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": True,
        "shared_expert_intermediate_size": 24, "mlp_only_layers": [1], "decoder_sparse_step": 1,
        "layer_types": ["linear_attention", "linear_attention", "linear_attention",
                        "full_attention"],
        "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8,
        "linear_value_head_dim": 6, "linear_conv_kernel_dim": 4,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                            "partial_rotary_factor": 0.25},
    }  # fmt: skip


QWEN3_NEXT = register(
    Family(
        model_type="qwen3_next",
        architectures=("Qwen3NextForCausalLM",),
        config_from_hf=config_from_hf,
        config_to_hf=config_to_hf,
        weights=Qwen3NextWeightMap(passthrough=mtp_keys),
        tiny_hf_config=tiny_hf_config,
        summary="Qwen3-Next: Gated DeltaNet + gated full attention (layer_types), zero-centred "
        "norms, partial rotary, softmax top-k with a gated shared expert; in_proj_qkvz/ba "
        "split on load; mtp.* passed through. Engine: GDN state per slot, prefix cache "
        "through state snapshots",
    )
)
