"""Qwen3.5 / Qwen3.6 MoE (e.g. Qwen3.6-35B-A3B): the Qwen3-Next architecture
(model/families/qwen3_next.py) with the GDN input projections stored split (`in_proj_qkv`,
`in_proj_z`, `in_proj_b`, `in_proj_a`: the model's own names), every layer MoE, and the router
always renormalising its top-k. Two registry entries:

- `qwen3_5_moe_text`: what transformers' `Qwen3_5MoeForCausalLM` saves (`model.*`, `lm_head`,
  `mtp.*`); loads and saves.
- `qwen3_5_moe`: a released checkpoint (`Qwen3_5MoeForConditionalGeneration`): config under
  `text_config`, the language model under `model.language_model.*`, a vision tower under
  `model.visual.*`. The language model is loaded, the vision tower left out (a policy trained
  on text); saving writes the text layout (`qwen3_5_moe_text`, which transformers'
  `Qwen3_5MoeForCausalLM` loads), since the vision tower is not kept.

RoPE: the released text configs carry multimodal RoPE sections (`mrope_section`,
`mrope_interleaved`); for text, whose three position axes are equal, that is plain RoPE on the
rotated dims (transformers' `Qwen3_5MoeTextRotaryEmbedding` with equal axes), so they are
accepted and not written back."""

from __future__ import annotations

from typing import Any

from slipstream.config.model import ModelConfig
from slipstream.model.families import Family, StandardWeightMap, register, require
from slipstream.model.families.qwen3_next import hybrid_from_hf, hybrid_to_hf, mtp_keys

_TEXT_FIXED = dict(norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])


def _text_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    fields = hybrid_from_hf(hf)
    fields.update(_TEXT_FIXED, intermediate_size=hf["moe_intermediate_size"])
    return fields


def config_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    return _text_from_hf(hf)


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    require(cfg, "qwen3_5_moe_text", **_TEXT_FIXED)
    return hybrid_to_hf(cfg, QWEN3_5_MOE_TEXT)


def multimodal_config_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    text = dict(hf.get("text_config") or {})
    if not text:
        raise ValueError("config.json of a qwen3_5_moe checkpoint has no text_config")
    text.setdefault("tie_word_embeddings", hf.get("tie_word_embeddings", False))
    return _text_from_hf(text)


def multimodal_config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """The text layout (see the module docstring): the vision tower was not loaded."""
    return config_to_hf(cfg)


def tiny_hf_config() -> dict[str, Any]:
    return {
        "model_type": "qwen3_5_moe_text", "vocab_size": 96, "hidden_size": 32,
        "moe_intermediate_size": 16, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2,
        "shared_expert_intermediate_size": 24,
        "layer_types": ["linear_attention", "linear_attention", "linear_attention",
                        "full_attention"],
        "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8,
        "linear_value_head_dim": 6, "linear_conv_kernel_dim": 4,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                            "partial_rotary_factor": 0.25},
    }  # fmt: skip


def tiny_multimodal_hf_config() -> dict[str, Any]:
    return {
        "model_type": "qwen3_5_moe",
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "text_config": tiny_hf_config(),
        "vision_config": {"depth": 1, "hidden_size": 16, "intermediate_size": 16,
                          "num_heads": 2, "out_hidden_size": 32},
    }  # fmt: skip


_LM_PREFIX, _VISION_PREFIX = "model.language_model.", "model.visual."


class MultimodalWeightMap(StandardWeightMap):
    """A released checkpoint: `model.language_model.*` -> `model.*`, `model.visual.*` left out,
    `mtp.*` passed through; saved in the text layout."""

    def from_hf(self, sd, cfg):  # type: ignore[no-untyped-def]
        text = {
            ("model." + k.removeprefix(_LM_PREFIX) if k.startswith(_LM_PREFIX) else k): t
            for k, t in sd.items()
            if not k.startswith(_VISION_PREFIX)
        }
        return super().from_hf(text, cfg)

    def rows(self, source, name, lo, hi, cfg):  # type: ignore[no-untyped-def]
        return super().rows(_LanguageModelSource(source), name, lo, hi, cfg)


class _LanguageModelSource:
    """A `RowSource` reading `model.X` from `model.language_model.X` where the checkpoint has it."""

    def __init__(self, source: Any) -> None:
        self.source = source

    def _disk(self, name: str) -> str:
        if name.startswith("model.") and not self.source.has(name):
            return _LM_PREFIX + name.removeprefix("model.")
        return name

    def has(self, name: str) -> bool:
        return self.source.has(self._disk(name))

    def slice(self, name: str, lo: int | None, hi: int | None):  # type: ignore[no-untyped-def]
        return self.source.slice(self._disk(name), lo, hi)


QWEN3_5_MOE_TEXT = register(
    Family(
        model_type="qwen3_5_moe_text",
        architectures=("Qwen3_5MoeForCausalLM",),
        config_from_hf=config_from_hf,
        config_to_hf=config_to_hf,
        weights=StandardWeightMap(passthrough=mtp_keys),
        tiny_hf_config=tiny_hf_config,
        summary="Qwen3.5/3.6 MoE, text layout: Gated DeltaNet + gated attention as Qwen3-Next, "
        "split GDN projections, every layer MoE; mtp.* passed through. Engine: GDN state per slot, "
        "prefix cache through state snapshots",
    )
)
QWEN3_5_MOE = register(
    Family(
        model_type="qwen3_5_moe",
        architectures=("Qwen3_5MoeForConditionalGeneration",),
        config_from_hf=multimodal_config_from_hf,
        config_to_hf=multimodal_config_to_hf,
        weights=MultimodalWeightMap(passthrough=mtp_keys),
        tiny_hf_config=tiny_multimodal_hf_config,
        summary="Qwen3.5/3.6 MoE released (multimodal) checkpoints: the language model loaded, "
        "the vision tower left out, saved in the text layout",
    )
)
