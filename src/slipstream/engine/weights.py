"""Loading new policy weights into a live model (the engine's hot-swap)."""

from __future__ import annotations

import tempfile
from collections.abc import Mapping
from pathlib import Path

import torch

WeightSource = Mapping[str, torch.Tensor] | str | Path
"""A state dict with HF names (per-expert or fused layout; `model.state_dict()` qualifies), an
HF-format directory (safetensors, single file or sharded), or the URL of one that fsspec can read
(s3://bucket/ckpt, file:///path, ...)."""

# What a checkpoint directory must provide for the weights; config/tokenizer files are not needed.
_WEIGHT_FILES = (".safetensors", ".safetensors.index.json")


def load_weights_into(model: torch.nn.Module, source: WeightSource) -> None:
    """Copy weights into `model` in place (parameter identity kept). Strict: missing or
    unexpected names and wrong shapes raise ValueError naming them; an unreadable source raises
    ValueError or OSError."""
    from slipstream.model import load_hf_state_dict, read_safetensors_dir

    if isinstance(source, str) and "://" in source:
        with tempfile.TemporaryDirectory(prefix="slipstream-weights-") as tmp:
            _download(source, Path(tmp))
            state = read_safetensors_dir(tmp)
    elif isinstance(source, str | Path):
        if not Path(source).is_dir():
            raise ValueError(f"update_weights: {source} is not a directory")
        state = read_safetensors_dir(source)
    else:
        state = dict(source)
    load_hf_state_dict(model, state)  # type: ignore[arg-type]


def _download(url: str, directory: Path) -> None:
    """Copy the safetensors files (and shard index) of a checkpoint URL into `directory`."""
    import fsspec

    fs, root = fsspec.core.url_to_fs(url)
    if not fs.isdir(root):
        raise ValueError(f"update_weights: {url} is not a directory")
    names = [p for p in fs.ls(root, detail=False) if p.endswith(_WEIGHT_FILES)]
    if not names:
        raise ValueError(f"update_weights: {url} holds no .safetensors files")
    for remote in names:
        fs.get(remote, str(directory / Path(remote).name))
