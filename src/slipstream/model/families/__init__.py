"""Model families as specs: one registry keyed by the HF `model_type`.

A family says how one Hugging Face architecture maps onto slipstream's one model
(model/transformer.py's `MoEForCausalLM`, built from `ModelConfig` fields alone): nothing outside
this package asks which family a model is (no `if model_type ==` in the trainer, engine, expert
parallelism, R3, weight transport or checkpoint code). They call `family_of(cfg)` /
`family_for(model_type)` and use the spec.

Contract of a `Family` (one module per family in this package, registered with `register`):
- `model_type`: the HF `model_type` key; `architectures`: what config.json names.
- `config_from_hf(hf) -> dict`: `ModelConfig` fields from a config.json dict (`model_type` is
  added by the caller). Raise `ValueError` naming the key for anything the model does not
  implement (never drop a feature silently). `common_from_hf` reads the fields every family
  shares.
- `config_to_hf(cfg) -> dict`: the config.json transformers loads for this family (the caller
  adds dtype). Raise `ValueError` for a `cfg` this family cannot express (`require`).
- `weights`: a `WeightMap` (below): the checkpoint weight map.
- `tiny_hf_config() -> dict`: a tiny config.json with every feature of the family switched on
  (biases, n_group > 1, ...): what tests/unit/test_families.py builds transformers' reference
  model from.
- The architecture (which blocks each layer uses) is the `ModelConfig` fields the family sets:
  attention variant (`attention_bias`, `attention_out_bias`, `qk_norm`, `clip_qkv`,
  `partial_rotary_factor`, part B: sinks, windows, YaRN), the routing scheme (`router_scheme`,
  model/router.py), experts (part B: `expert_bias`, `expert_activation`), shared experts
  (`shared_expert_intermediate_size`, `shared_expert_gated`) and the dense layers
  (`mlp_only_layers`, `decoder_sparse_step`). A feature no field expresses is a new field and a
  block option, not a family check in the model.

Contract of a `WeightMap`. Internal names are the model's `state_dict()` names, which are the
transformers-5 *in-memory* names of the family (stacked experts `mlp.experts.gate_up_proj`
(E, 2I, D) gate rows first, `mlp.experts.down_proj` (E, D, I), router `mlp.gate.*`):
- `to_hf(sd, cfg, fused_experts) -> dict`: internal -> HF names, views where possible (no copy).
  `fused_experts=True` gives the in-memory layout, False the on-disk one (what `save_pretrained`
  writes and what transformers' loaders expect on disk).
- `from_hf(sd, cfg) -> (internal, passthrough)`: either layout -> internal names (stacking
  per-expert tensors, dequantising on load: the family's hook), plus the tensors the family keeps
  without a parameter of their own (e.g. GLM's MTP layers `model.layers.{L+}.*`), which
  `save_pretrained` writes back unchanged. Unknown names stay in `internal` (the caller's strict
  check names them). Applied once per source: internal tensors are never mapped again
  (`load_internal_state_dict`; a family's on-disk names may equal internal ones in another
  layout, as GPT-OSS's experts do).
- `rows(source, name, lo, hi, cfg) -> Tensor`: rows [lo, hi) of internal parameter `name` (for
  experts: experts lo..hi-1) read from a checkpoint through `source` (`RowSource`: `has(name)`,
  `slice(name, lo, hi)` of an on-disk tensor): what expert-parallel sharded loading reads.
`StandardWeightMap` implements these for families whose disk layout is per-expert
`{prefix}.{e}.{gate,up,down}.weight` with optional renames (Mixtral: `block_sparse_moe`, w1/w3/w2).

Adding a family: a module here with a `Family(...)` passed to `register`, imported at the bottom
of this file; a row in tests/unit/test_families.py; a line in docs/model.md.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from slipstream.config.model import ModelConfig


class RowSource(Protocol):
    def has(self, name: str) -> bool:
        """The checkpoint holds a tensor `name`."""
        ...

    def slice(self, name: str, lo: int | None, hi: int | None) -> torch.Tensor:
        """Rows [lo, hi) (dim 0) of on-disk tensor `name`; None bounds: all."""
        ...


class WeightMap(Protocol):
    def to_hf(
        self, sd: dict[str, torch.Tensor], cfg: ModelConfig, fused_experts: bool
    ) -> dict[str, torch.Tensor]: ...

    def from_hf(
        self, sd: dict[str, torch.Tensor], cfg: ModelConfig
    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]: ...

    def rows(
        self, source: RowSource, name: str, lo: int, hi: int, cfg: ModelConfig
    ) -> torch.Tensor: ...


_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def mtp_layers(name: str, cfg: ModelConfig) -> bool:
    """A tensor of a layer beyond the decoder's (`model.layers.{i}` with i >= num_hidden_layers:
    DeepSeek/GLM multi-token-prediction layers): kept and written back, not built or trained."""
    m = _LAYER.match(name)
    return m is not None and int(m.group(1)) >= cfg.num_hidden_layers


@dataclass(frozen=True)
class StandardWeightMap:
    """Disk layout: per-expert `{layer}.{expert_prefix}.{e}.{gate,up,down}.weight` (names
    `expert_projs`), other names as in memory after `renames` ((in-memory, on-disk) substring
    pairs, applied in order). `passthrough(name, cfg)`: tensors kept aside (see the module
    docstring)."""

    renames: tuple[tuple[str, str], ...] = ()
    expert_projs: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    passthrough: Callable[[str, ModelConfig], bool] | None = None
    _per_expert: re.Pattern[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        names = "|".join(re.escape(p) for p in self.expert_projs)
        pattern = re.compile(rf"^(.*\.experts)\.(\d+)\.({names})\.weight$")
        object.__setattr__(self, "_per_expert", pattern)

    def disk_name(self, name: str) -> str:
        for mem, disk in self.renames:
            name = name.replace(mem, disk)
        return name

    def memory_name(self, name: str) -> str:
        for mem, disk in reversed(self.renames):
            name = name.replace(disk, mem)
        return name

    def to_hf(self, sd, cfg, fused_experts):  # type: ignore[no-untyped-def]
        sd = dict(sd)
        if cfg.tie_word_embeddings:
            sd.pop("lm_head.weight", None)
        if fused_experts:
            return sd
        gate, up, down = self.expert_projs
        out: dict[str, torch.Tensor] = {}
        for name, t in sd.items():
            if name.endswith(".mlp.experts.gate_up_proj"):
                prefix = self.disk_name(name.removesuffix(".gate_up_proj"))
                inter = t.shape[1] // 2
                for e in range(t.shape[0]):
                    out[f"{prefix}.{e}.{gate}.weight"] = t[e, :inter]
                    out[f"{prefix}.{e}.{up}.weight"] = t[e, inter:]
            elif name.endswith(".mlp.experts.down_proj"):
                prefix = self.disk_name(name.removesuffix(".down_proj"))
                for e in range(t.shape[0]):
                    out[f"{prefix}.{e}.{down}.weight"] = t[e]
            else:
                out[self.disk_name(name)] = t
        return out

    def from_hf(self, sd, cfg):  # type: ignore[no-untyped-def]
        out: dict[str, torch.Tensor] = {}
        passthrough: dict[str, torch.Tensor] = {}
        groups: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
        for name, t in sd.items():
            if self.passthrough is not None and self.passthrough(name, cfg):
                passthrough[name] = t
                continue
            m = self._per_expert.match(name)
            if m is None:
                out[self.memory_name(name)] = t
                continue
            prefix = self.memory_name(m.group(1))
            groups.setdefault(prefix, {}).setdefault(m.group(3), {})[int(m.group(2))] = t
        num_experts = cfg.num_experts
        gate, up, down = self.expert_projs
        for prefix, projs in groups.items():
            for proj in self.expert_projs:
                have = sorted(projs.get(proj, {}))
                if have != list(range(num_experts)):
                    raise ValueError(
                        f"{self.disk_name(prefix)}.*.{proj}: found experts {have}, expected "
                        f"0..{num_experts - 1}"
                    )
            stack = {p: torch.stack([projs[p][e] for e in range(num_experts)]) for p in projs}
            out[f"{prefix}.gate_up_proj"] = torch.cat([stack[gate], stack[up]], dim=1)
            out[f"{prefix}.down_proj"] = stack[down]
        return out, passthrough

    def rows(self, source, name, lo, hi, cfg):  # type: ignore[no-untyped-def]
        if name.endswith(".mlp.experts.gate_up_proj") or name.endswith(".mlp.experts.down_proj"):
            if source.has(name):  # the fused transformers-5 layout
                return source.slice(name, lo, hi)
            prefix, proj = name.rsplit(".", 1)
            prefix = self.disk_name(prefix)
            gate, up, down = self.expert_projs
            parts = []
            for e in range(lo, hi):
                if proj == "gate_up_proj":
                    g = source.slice(f"{prefix}.{e}.{gate}.weight", None, None)
                    u = source.slice(f"{prefix}.{e}.{up}.weight", None, None)
                    parts.append(torch.cat([g, u], dim=0))
                else:
                    parts.append(source.slice(f"{prefix}.{e}.{down}.weight", None, None))
            if not parts:
                raise ValueError(f"{name}: empty expert range [{lo}, {hi})")
            return torch.stack(parts)
        disk = self.disk_name(name)
        return source.slice(disk if source.has(disk) else name, lo, hi)


@dataclass(frozen=True)
class Family:
    """One model family (see the module docstring)."""

    model_type: str
    architectures: tuple[str, ...]
    config_from_hf: Callable[[dict[str, Any]], dict[str, Any]]
    config_to_hf: Callable[[ModelConfig], dict[str, Any]]
    weights: WeightMap
    tiny_hf_config: Callable[[], dict[str, Any]]
    summary: str = ""
    """One line for docs and errors: what the family is and what of it is supported."""


_REGISTRY: dict[str, Family] = {}


def register(family: Family) -> Family:
    if family.model_type in _REGISTRY:
        raise ValueError(f"model family {family.model_type!r} registered twice")
    _REGISTRY[family.model_type] = family
    return family


def family_for(model_type: str | None) -> Family:
    """The family of an HF `model_type`; a ValueError listing the supported ones otherwise."""
    if model_type not in _REGISTRY:
        raise ValueError(
            f"model_type={model_type!r} is not a supported model family; supported: "
            f"{', '.join(sorted(_REGISTRY))}"
        )
    return _REGISTRY[model_type]  # type: ignore[index]


def family_of(cfg: ModelConfig) -> Family:
    """The family of a model config (`cfg.model_type`)."""
    return family_for(cfg.model_type)


def families() -> dict[str, Family]:
    """Every registered family by model_type (a copy)."""
    return dict(_REGISTRY)


# ---- helpers the family modules share ------------------------------------------------------


def reject(hf: dict[str, Any], key: str, ok: Any, why: str) -> None:
    """A config.json key whose value (when present and not None) must be `ok`."""
    value = hf.get(key)
    if value is not None and value != ok:
        raise ValueError(f"config.json {key}={value!r} is not supported: {why}")


def require(cfg: ModelConfig, family: str, **expected: Any) -> None:
    """`cfg` fields a family's checkpoint format fixes (config_to_hf of a config it cannot
    express raises, naming the field)."""
    have = cfg.model_dump(include=set(expected))
    for key, value in expected.items():
        if have[key] != value:
            raise ValueError(
                f"model.{key}={have[key]!r} cannot be saved as a {family} checkpoint (the "
                f"family has {value!r})"
            )


def rope_of(hf: dict[str, Any]) -> dict[str, Any]:
    return hf.get("rope_parameters") or hf.get("rope_scaling") or {}


def common_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """The fields every family reads the same way (sizes, norms, plain RoPE theta, tying);
    rejects non-silu activations and RoPE scaling (a family that implements one reads it
    itself before calling this with it removed)."""
    reject(hf, "hidden_act", "silu", "only SwiGLU with silu is implemented")
    rope = rope_of(hf)
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise ValueError(f"config.json rope {rope!r}: this family reads default RoPE only")
    keys = (
        "vocab_size hidden_size num_hidden_layers num_attention_heads num_key_value_heads "
        "head_dim max_position_embeddings rms_norm_eps tie_word_embeddings initializer_range "
        "rope_theta"
    ).split()
    fields = {k: hf[k] for k in keys if hf.get(k) is not None}
    if "rope_theta" in rope:
        fields["rope_theta"] = rope["rope_theta"]
    fields.setdefault("head_dim", hf["hidden_size"] // hf["num_attention_heads"])
    if fields.get("num_key_value_heads") is None:
        fields["num_key_value_heads"] = hf["num_attention_heads"]
    return fields


def common_to_hf(cfg: ModelConfig, family: Family, **rope_extra: Any) -> dict[str, Any]:
    """config.json keys every family writes the same way."""
    return {
        "architectures": list(family.architectures),
        "model_type": family.model_type,
        "hidden_act": "silu",
        "attention_dropout": 0.0,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "initializer_range": cfg.initializer_range,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta, **rope_extra},
    }


# The families (each module registers itself on import).
from slipstream.model.families import (  # noqa: E402, F401
    deepseek_v3,
    glm4_moe,
    gpt_oss,
    mixtral,
    olmoe,
    qwen3_5_moe,
    qwen3_moe,
    qwen3_next,
)
