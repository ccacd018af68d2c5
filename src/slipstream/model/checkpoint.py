"""Hugging Face checkpoint I/O: config.json <-> ModelConfig, state-dict layout conversion, and
(sharded) safetensors save/load.

On-disk expert layout written: per-expert `mlp.experts.{e}.{gate,up,down}_proj.weight`, which is
what transformers 5 itself writes for Qwen3-MoE (it fuses on load) and what the classic Hub
checkpoints and transformers 4.x use. Loading accepts that layout and the fused transformers-5
in-memory layout (`mlp.experts.gate_up_proj` (E, 2I, D), `mlp.experts.down_proj` (E, D, I)).
Dense Qwen3 checkpoints (model_type "qwen3") load as a model whose layers are all dense.

Not covered: remote paths (fsspec), pytorch_model.bin, rope scaling, sliding-window attention,
attention biases (all rejected loudly); a non-zero shared expert or router z-loss coefficient is
written to config.json as extra keys that transformers' Qwen3-MoE ignores.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from slipstream.config.model import ModelConfig
from slipstream.model.transformer import MoEForCausalLM

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_PER_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_ARCH_FIELDS = (
    "vocab_size hidden_size num_hidden_layers num_attention_heads num_key_value_heads head_dim "
    "intermediate_size moe_intermediate_size num_experts num_experts_per_tok norm_topk_prob "
    "decoder_sparse_step mlp_only_layers shared_expert_intermediate_size max_position_embeddings "
    "rope_theta rms_norm_eps router_aux_loss_coef router_z_loss_coef tie_word_embeddings "
    "initializer_range"
).split()


def _reject(hf: dict[str, Any], key: str, ok: Any, why: str) -> None:
    value = hf.get(key)
    if value is not None and value != ok:
        raise ValueError(f"config.json {key}={value!r} is not supported: {why}")


def model_config_from_hf(hf: dict[str, Any] | str | Path, **overrides: Any) -> ModelConfig:
    """ModelConfig from an HF config (dict, config.json path, or checkpoint directory).
    Accepts model_type "qwen3_moe" and "qwen3" (dense: every layer in mlp_only_layers).
    Keyword overrides (e.g. vocab_size=1024) are applied last."""
    if not isinstance(hf, dict):
        path = Path(hf)
        path = path / "config.json" if path.is_dir() else path
        if not path.is_file():
            raise FileNotFoundError(f"no HF config at {path}")
        hf = json.loads(path.read_text())
    model_type = hf.get("model_type")
    if model_type not in ("qwen3_moe", "qwen3"):
        raise ValueError(f"config.json model_type={model_type!r}; supported: 'qwen3_moe', 'qwen3'")
    _reject(hf, "hidden_act", "silu", "only SwiGLU with silu is implemented")
    _reject(hf, "attention_bias", False, "q/k/v/o projections have no bias here")
    _reject(hf, "use_sliding_window", False, "sliding-window attention is not implemented")
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise ValueError(f"config.json rope {rope!r}: only default RoPE is implemented")
    fields: dict[str, Any] = {k: hf[k] for k in _ARCH_FIELDS if k in hf and hf[k] is not None}
    if "num_experts" not in fields and hf.get("num_local_experts") is not None:
        fields["num_experts"] = hf["num_local_experts"]
    if "rope_theta" in rope:
        fields["rope_theta"] = rope["rope_theta"]
    fields.setdefault("head_dim", hf["hidden_size"] // hf["num_attention_heads"])
    if model_type == "qwen3":
        fields.update(
            num_experts=1,
            num_experts_per_tok=1,
            moe_intermediate_size=hf["intermediate_size"],
            mlp_only_layers=list(range(hf["num_hidden_layers"])),
        )
    return ModelConfig(**{**fields, **overrides})


def hf_config_from_model_config(cfg: ModelConfig, dtype: torch.dtype) -> dict[str, Any]:
    """config.json content readable by transformers 4.x and 5.x `Qwen3MoeConfig`."""
    out: dict[str, Any] = {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "sliding_window": None,
        "dtype": str(dtype).removeprefix("torch."),
        "torch_dtype": str(dtype).removeprefix("torch."),
        "num_local_experts": cfg.num_experts,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
    }
    out.update({k: getattr(cfg, k) for k in _ARCH_FIELDS})
    if cfg.shared_expert_intermediate_size == 0:
        del out["shared_expert_intermediate_size"]
    return out


def state_dict_to_hf(model: MoEForCausalLM, fused_experts: bool = False) -> dict[str, torch.Tensor]:
    """The model's weights under HF names. fused_experts=False: per-expert tensors (disk layout,
    views into the stacked parameters, no copy); True: the stacked transformers-5 layout (identical
    to `model.state_dict()`). lm_head.weight is omitted when tied to the embedding."""
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    return hf_from_internal(sd, model.config, fused_experts)


def hf_from_internal(
    sd: dict[str, torch.Tensor], cfg: ModelConfig, fused_experts: bool = False
) -> dict[str, torch.Tensor]:
    """An internal (stacked-experts) state dict under HF names; see `state_dict_to_hf`."""
    sd = dict(sd)
    if cfg.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    if fused_experts:
        return sd
    out: dict[str, torch.Tensor] = {}
    for name, t in sd.items():
        if name.endswith(".mlp.experts.gate_up_proj"):
            prefix, inter = name.removesuffix(".gate_up_proj"), t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{prefix}.{e}.gate_proj.weight"] = t[e, :inter]
                out[f"{prefix}.{e}.up_proj.weight"] = t[e, inter:]
        elif name.endswith(".mlp.experts.down_proj"):
            prefix = name.removesuffix(".down_proj")
            for e in range(t.shape[0]):
                out[f"{prefix}.{e}.down_proj.weight"] = t[e]
        else:
            out[name] = t
    return out


def hf_weights(model: MoEForCausalLM) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(state dict under HF names, config.json) of a model: what a published weight version and
    an exported checkpoint hold."""
    dtype = next(model.parameters()).dtype
    return state_dict_to_hf(model), hf_config_from_model_config(model.config, dtype)


def hf_to_internal(sd: dict[str, torch.Tensor], num_experts: int) -> dict[str, torch.Tensor]:
    """Stack per-expert HF tensors into the fused layout; other names pass through."""
    out: dict[str, torch.Tensor] = {}
    groups: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    for name, t in sd.items():
        m = _PER_EXPERT.match(name)
        if m is None:
            out[name] = t
            continue
        groups.setdefault(m.group(1), {}).setdefault(m.group(3), {})[int(m.group(2))] = t
    for prefix, projs in groups.items():
        for proj in ("gate_proj", "up_proj", "down_proj"):
            have = sorted(projs.get(proj, {}))
            if have != list(range(num_experts)):
                raise ValueError(
                    f"{prefix}.*.{proj}: found experts {have}, expected 0..{num_experts - 1}"
                )
        stack = {p: torch.stack([projs[p][e] for e in range(num_experts)]) for p in projs}
        out[f"{prefix}.gate_up_proj"] = torch.cat([stack["gate_proj"], stack["up_proj"]], dim=1)
        out[f"{prefix}.down_proj"] = stack["down_proj"]
    return out


@torch.no_grad()
def load_hf_state_dict(model: MoEForCausalLM, sd: dict[str, torch.Tensor]) -> None:
    """Load HF-named weights (per-expert or fused layout) into `model` in place (copy_, so tensor
    identity, device and dtype of the model's parameters are kept: suitable for hot-swapping the
    weights of a live inference model). Strict: missing or unexpected names raise, naming them."""
    internal = hf_to_internal(sd, model.config.num_experts)
    if model.config.tie_word_embeddings:
        internal.pop("lm_head.weight", None)
        internal.setdefault("lm_head.weight", internal.get("model.embed_tokens.weight"))
    params = dict(model.state_dict())
    missing = sorted(set(params) - set(internal))
    unexpected = sorted(set(internal) - set(params))
    if missing or unexpected:
        raise ValueError(f"checkpoint mismatch: missing {missing[:8]}, unexpected {unexpected[:8]}")
    meta = next(model.parameters()).device.type == "meta"
    for name, t in internal.items():
        if tuple(t.shape) != tuple(params[name].shape):
            raise ValueError(
                f"{name}: checkpoint shape {tuple(t.shape)} != {tuple(params[name].shape)}"
            )
    if meta:
        model.load_state_dict(internal, strict=True, assign=True)
    else:
        for name, t in internal.items():
            params[name].copy_(t)
    model.tie_weights()


def _shard(sd: dict[str, torch.Tensor], max_shard_bytes: int) -> list[dict[str, torch.Tensor]]:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in sd.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    return shards


def save_pretrained(
    model: MoEForCausalLM,
    directory: str | Path,
    max_shard_bytes: int = 5 * 2**30,
    dtype: torch.dtype | None = None,
) -> Path:
    """Write config.json + safetensors (per-expert HF layout) to `directory`, sharded as
    model-0000i-of-0000n.safetensors + model.safetensors.index.json when the weights exceed
    `max_shard_bytes` (a single tensor larger than that gets its own shard). `dtype` casts
    floating tensors (default: keep the model's). Returns the directory."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    sd = state_dict_to_hf(model)
    dtype = dtype or next(model.parameters()).dtype
    sd = {k: v.to(device="cpu", dtype=dtype).contiguous().clone() for k, v in sd.items()}
    (directory / "config.json").write_text(
        json.dumps(hf_config_from_model_config(model.config, dtype), indent=2) + "\n"
    )
    for old in [*directory.glob("model*.safetensors"), directory / INDEX_FILE]:
        old.unlink(missing_ok=True)
    shards = _shard(sd, max_shard_bytes)
    if len(shards) == 1:
        save_file(shards[0], str(directory / SINGLE_FILE), metadata={"format": "pt"})
        return directory
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(directory / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, fname))
    total = sum(t.numel() * t.element_size() for t in sd.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return directory


def read_safetensors_dir(
    directory: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """All tensors of a single-file or sharded (index.json) safetensors checkpoint."""
    directory = Path(directory)
    if (directory / INDEX_FILE).is_file():
        index = json.loads((directory / INDEX_FILE).read_text())
        files = sorted(set(index["weight_map"].values()))
    elif (directory / SINGLE_FILE).is_file():
        files = [SINGLE_FILE]
    else:
        raise FileNotFoundError(f"{directory}: neither {SINGLE_FILE} nor {INDEX_FILE}")
    sd: dict[str, torch.Tensor] = {}
    for fname in files:
        with safe_open(str(directory / fname), framework="pt", device=str(device)) as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                t = f.get_tensor(name)
                sd[name] = t.to(dtype) if dtype is not None and t.is_floating_point() else t
    return sd


class RowReader:
    """Reads row ranges (dim 0) of the model's *internal* parameters out of an HF-format
    directory, touching only those rows on disk (safetensors slices): what a rank that holds a
    shard of each parameter needs. Experts are read per expert from either on-disk layout.

        with RowReader(directory) as reader:
            rows = reader.rows("model.layers.0.mlp.experts.gate_up_proj", 2, 4)   # experts 2, 3
    """

    def __init__(self, directory: str | Path, dtype: torch.dtype | None = None) -> None:
        directory = Path(directory)
        if (directory / INDEX_FILE).is_file():
            weight_map = json.loads((directory / INDEX_FILE).read_text())["weight_map"]
        elif (directory / SINGLE_FILE).is_file():
            with safe_open(str(directory / SINGLE_FILE), framework="pt") as f:
                weight_map = dict.fromkeys(f.keys(), SINGLE_FILE)
        else:
            raise FileNotFoundError(f"{directory}: neither {SINGLE_FILE} nor {INDEX_FILE}")
        self.directory, self.dtype, self.weight_map = directory, dtype, weight_map
        self.config = model_config_from_hf(directory)
        self._files: dict[str, Any] = {}

    def __enter__(self) -> RowReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for f in self._files.values():
            f.__exit__(None, None, None)
        self._files.clear()

    def _slice(self, name: str, lo: int, hi: int) -> torch.Tensor:
        if name not in self.weight_map:
            raise KeyError(f"{self.directory}: no tensor {name}")
        fname = self.weight_map[name]
        if fname not in self._files:
            handle = safe_open(str(self.directory / fname), framework="pt")
            self._files[fname] = handle.__enter__()
        t = self._files[fname].get_slice(name)[lo:hi]
        return t.to(self.dtype) if self.dtype is not None and t.is_floating_point() else t

    def rows(self, name: str, lo: int, hi: int) -> torch.Tensor:
        """Rows [lo, hi) of internal parameter `name` (for expert weights: experts lo..hi-1)."""
        if name == "lm_head.weight" and self.config.tie_word_embeddings:
            name = "model.embed_tokens.weight"
        if name.endswith(".mlp.experts.gate_up_proj") or name.endswith(".mlp.experts.down_proj"):
            prefix, proj = name.rsplit(".", 1)
            if name in self.weight_map:  # the fused transformers-5 layout
                return self._slice(name, lo, hi)
            parts = []
            for e in range(lo, hi):
                if proj == "gate_up_proj":
                    gate = self._slice(f"{prefix}.{e}.gate_proj.weight", 0, None)  # type: ignore[arg-type]
                    up = self._slice(f"{prefix}.{e}.up_proj.weight", 0, None)  # type: ignore[arg-type]
                    parts.append(torch.cat([gate, up], dim=0))
                else:
                    parts.append(self._slice(f"{prefix}.{e}.down_proj.weight", 0, None))  # type: ignore[arg-type]
            if not parts:
                raise ValueError(f"{name}: empty expert range [{lo}, {hi})")
            return torch.stack(parts)
        return self._slice(name, lo, hi)


def load_pretrained(
    directory: str | Path,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = torch.float32,
    **config_overrides: Any,
) -> MoEForCausalLM:
    """Build an MoEForCausalLM from an HF-format directory (qwen3_moe or dense qwen3), weights
    cast to `dtype` (None keeps the stored dtype) on `device`. Built on the meta device, so no
    random init is paid. Returned in eval mode. `config_overrides` go to ModelConfig (e.g.
    max_position_embeddings=1024); not `moe_impl`, which no build reads: apply it with
    model/converters.py's `ExpertPath` (an error here, rather than a model on another path)."""
    if "moe_impl" in config_overrides:
        raise ValueError(
            "load_pretrained(moe_impl=...): the expert path is a converter applied to the "
            "loaded model (model/converters.py: apply_converters(model, model_converters(impl)))"
        )
    cfg = model_config_from_hf(directory, **config_overrides)
    sd = read_safetensors_dir(directory, device=device, dtype=dtype)
    with torch.device("meta"):
        model = MoEForCausalLM(cfg)
    load_hf_state_dict(model, sd)
    return model.eval()
