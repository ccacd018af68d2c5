"""Loading new policy weights into a live model (the engine's hot-swap)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch

WeightSource = Mapping[str, torch.Tensor] | str | Path
"""A state dict with HF names (per-expert or fused layout; `model.state_dict()` qualifies) or an
HF-format directory (safetensors, single file or sharded)."""


def load_weights_into(model: torch.nn.Module, source: WeightSource) -> None:
    """Copy weights into `model` in place (parameter identity kept): a state dict with HF names
    (per-expert or fused layout; `model.state_dict()` qualifies) or an HF-format directory.
    Strict: missing or unexpected names and wrong shapes raise ValueError naming them."""
    from slipstream.model import load_hf_state_dict, read_safetensors_dir

    if isinstance(source, str | Path):
        if not Path(source).is_dir():
            raise ValueError(f"update_weights: {source} is not a directory")
        state = read_safetensors_dir(source)
    else:
        state = dict(source)
    load_hf_state_dict(model, state)  # type: ignore[arg-type]
