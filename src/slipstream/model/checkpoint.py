"""Hugging Face checkpoint I/O: config.json <-> ModelConfig, state-dict layout conversion, and
(sharded) safetensors save/load, for every registered model family (model/families/): the
family's spec maps the config and the weight names (renames, per-expert <-> stacked experts,
passthrough tensors); this module is family-agnostic.

Loading accepts the family's on-disk layout (what transformers 5 writes: per-expert tensors for
qwen3_moe / olmoe / glm4_moe, `block_sparse_moe.experts.{e}.w1/w3/w2` for Mixtral) and the
transformers-5 in-memory layout (`mlp.experts.gate_up_proj` (E, 2I, D), `mlp.experts.down_proj`
(E, D, I)); saving writes the on-disk layout. Dense Qwen3 checkpoints (model_type "qwen3") load
as a model whose layers are all dense.

Not covered: remote paths (fsspec), pytorch_model.bin; a feature a family's model does not
implement is rejected loudly by its `config_from_hf`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from slipstream.config.model import ModelConfig
from slipstream.model.families import family_for, family_of
from slipstream.model.transformer import MoEForCausalLM

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def model_config_from_hf(hf: dict[str, Any] | str | Path, **overrides: Any) -> ModelConfig:
    """ModelConfig from an HF config (dict, config.json path, or checkpoint directory) of any
    registered family (model/families/: qwen3_moe, qwen3, mixtral, olmoe, glm4_moe, ...); a
    feature the model does not implement is an error naming the key. Keyword overrides (e.g.
    vocab_size=1024) are applied last."""
    if not isinstance(hf, dict):
        path = Path(hf)
        path = path / "config.json" if path.is_dir() else path
        if not path.is_file():
            raise FileNotFoundError(f"no HF config at {path}")
        hf = json.loads(path.read_text())
    family = family_for(hf.get("model_type"))
    fields = family.config_from_hf(hf)
    return ModelConfig(**{"model_type": family.model_type, **fields, **overrides})


def hf_config_from_model_config(cfg: ModelConfig, dtype: torch.dtype) -> dict[str, Any]:
    """config.json content transformers reads for the model's family (`cfg.model_type`)."""
    out = family_of(cfg).config_to_hf(cfg)
    out["dtype"] = out["torch_dtype"] = str(dtype).removeprefix("torch.")
    return out


def state_dict_to_hf(model: MoEForCausalLM, fused_experts: bool = False) -> dict[str, torch.Tensor]:
    """The model's weights under HF names. fused_experts=False: the family's on-disk layout
    (per-expert tensors are views into the stacked parameters, no copy); True: the
    transformers-5 in-memory layout (identical to `model.state_dict()`). lm_head.weight is
    omitted when tied to the embedding. Buffers the family keeps (the router's
    `e_score_correction_bias`) are included; passthrough tensors (MTP layers) are not (see
    `save_pretrained`)."""
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    return hf_from_internal(sd, model.config, fused_experts)


def hf_from_internal(
    sd: dict[str, torch.Tensor], cfg: ModelConfig, fused_experts: bool = False
) -> dict[str, torch.Tensor]:
    """An internal (stacked-experts) state dict under HF names; see `state_dict_to_hf`."""
    return family_of(cfg).weights.to_hf(sd, cfg, fused_experts)


def hf_weights(model: MoEForCausalLM) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(state dict under HF names, config.json) of a model: what a published weight version and
    an exported checkpoint hold."""
    dtype = next(model.parameters()).dtype
    return state_dict_to_hf(model), hf_config_from_model_config(model.config, dtype)


def hf_to_internal(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """HF-named tensors (the family's on-disk or in-memory layout) under the model's internal
    names (per-expert tensors stacked); the family's passthrough tensors (MTP layers) are
    dropped (`load_hf_state_dict` keeps them)."""
    return family_of(cfg).weights.from_hf(sd, cfg)[0]


@torch.no_grad()
def load_hf_state_dict(model: MoEForCausalLM, sd: dict[str, torch.Tensor]) -> None:
    """Load HF-named weights (the family's on-disk or in-memory layout) into `model` in place
    (copy_, so tensor identity, device and dtype of the model's parameters are kept: suitable
    for hot-swapping the weights of a live inference model). Strict: missing or unexpected names
    raise, naming them. The family's passthrough tensors (e.g. MTP layers) are kept in
    `model.hf_passthrough` and written back by `save_pretrained`."""
    internal, passthrough = family_of(model.config).weights.from_hf(sd, model.config)
    load_internal_state_dict(model, internal)
    if passthrough:
        model.hf_passthrough = {k: v.detach().to("cpu") for k, v in passthrough.items()}


@torch.no_grad()
def load_internal_state_dict(model: MoEForCausalLM, internal: dict[str, torch.Tensor]) -> None:
    """`load_hf_state_dict` for tensors already under the model's internal names and layout
    (`hf_to_internal`'s output: the engine's prepared weight versions). No family mapping is
    applied again (a family's on-disk names may equal internal names with another layout)."""
    internal = dict(internal)
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
    sd = {k: v.to(device="cpu", dtype=dtype if v.is_floating_point() else v.dtype)
          .contiguous().clone() for k, v in sd.items()}  # fmt: skip
    sd.update({k: v.contiguous().clone() for k, v in model.hf_passthrough.items()})
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


def cast_stored(name: str, t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """A tensor read from disk in `dtype` (None: as stored). Quantised weights stay as stored
    (8-bit floats and their block scales `*_scale_inv`): the family's weight map dequantises
    them in float32 (model/fp8.py), so they are rounded to `dtype` once, as transformers does;
    a scale rounded to bfloat16 first would be off by up to 0.4%."""
    if dtype is None or not t.is_floating_point():
        return t
    if t.element_size() == 1 or name.endswith("_scale_inv"):
        return t
    return t.to(dtype)


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
                sd[name] = cast_stored(name, t, dtype)
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

    def has(self, name: str) -> bool:
        """`RowSource`: the checkpoint holds an on-disk tensor `name`."""
        return name in self.weight_map

    def slice(self, name: str, lo: int | None, hi: int | None) -> torch.Tensor:
        """`RowSource`: rows [lo, hi) of on-disk tensor `name` (None: all rows)."""
        if name not in self.weight_map:
            raise KeyError(f"{self.directory}: no tensor {name}")
        fname = self.weight_map[name]
        if fname not in self._files:
            handle = safe_open(str(self.directory / fname), framework="pt")
            self._files[fname] = handle.__enter__()
        t = self._files[fname].get_slice(name)[lo:hi]
        return cast_stored(name, t, self.dtype)

    def rows(self, name: str, lo: int, hi: int) -> torch.Tensor:
        """Rows [lo, hi) of internal parameter `name` (for expert weights: experts lo..hi-1),
        read through the family's weight map."""
        if name == "lm_head.weight" and self.config.tie_word_embeddings:
            name = "model.embed_tokens.weight"
        return family_of(self.config).weights.rows(self, name, lo, hi, self.config)


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
