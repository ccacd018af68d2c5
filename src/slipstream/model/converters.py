"""Model converters: the transforms applied once, in place, to a built policy, chosen by the
resolved config (torchtitan's `ModelConverter` idea: `convert` after the model is built, before
it trains or serves). Each is a small frozen record with one `convert(model)`; one factory,
`model_converters`, turns the config into the list; `apply_converters` runs it. A converter edits
the model, never the config: `model.config` stays the architecture it was built from.

    for converter in model_converters(cfg.model.moe_impl, cfg.trainer, device):
        converter.convert(model)            # or: apply_converters(model, [...])

- `ExpertPath` (`model.moe_impl`): which expert compute path every MoE block runs.
- `ActivationCheckpointing` (`trainer.activation_checkpointing`): recompute each decoder layer
  in backward.
- `CompileBlocks` (`trainer.compile_blocks`): regional `torch.compile` of each decoder layer
  (CUDA only: an error elsewhere, raised when the list is built).

Not converters: the compute precision (`trainer.precision`) is autocast around the trainer's
forward over float32 master weights (rl/trainer.py), not a change of the model; where the
grouped GEMM cannot run in that dtype, the expert path falls back or fails per `moe_impl`
(model/moe_block.py). The inference engine's static decode path (engine/decode.py `static_moe`) is
scoped to its decode calls and restores the converted path after them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

import torch

from slipstream.config.model import MOE_IMPLS, MoEImpl
from slipstream.config.rl import TrainerConfig
from slipstream.model.moe_block import SparseMoeBlock
from slipstream.model.transformer import MoEForCausalLM


class ModelConverter(Protocol):
    """One in-place transform of a built policy."""

    def convert(self, model: MoEForCausalLM) -> None:
        """Apply the transform to `model` (in place; idempotent)."""
        ...


@dataclass(frozen=True)
class ExpertPath:
    """Every MoE block of the model runs the expert path `impl` (model/moe_block.py)."""

    impl: MoEImpl

    def __post_init__(self) -> None:
        if self.impl not in MOE_IMPLS:
            raise ValueError(f"moe_impl={self.impl!r}; expected one of {MOE_IMPLS}")

    def convert(self, model: MoEForCausalLM) -> None:
        for module in model.modules():
            if isinstance(module, SparseMoeBlock):
                module.impl = self.impl


@dataclass(frozen=True)
class ActivationCheckpointing:
    """Recompute each decoder layer's activations in backward (training forwards without a
    cache; `MoEForCausalLM.forward`)."""

    def convert(self, model: MoEForCausalLM) -> None:
        model.gradient_checkpointing = True


@dataclass(frozen=True)
class CompileBlocks:
    """Compile each decoder layer (regional, as torchtitan; dynamic shapes, since the packed
    token count changes every step). `device`: where the model trains; CUDA only."""

    device: torch.device

    def __post_init__(self) -> None:
        if self.device.type != "cuda":
            raise ValueError(
                f"trainer.compile_blocks = true needs a CUDA device (got {self.device}): "
                "regional torch.compile is for GPU launch overhead"
            )

    def convert(self, model: MoEForCausalLM) -> None:
        for layer in model.model.layers:
            layer.compile(dynamic=True)


def model_converters(
    moe_impl: MoEImpl = "grouped",
    trainer: TrainerConfig | None = None,
    device: torch.device | str = "cpu",
) -> list[ModelConverter]:
    """The converters the resolved config asks for, in the order they apply: the expert path
    (`model.moe_impl`), then, for a training model (`trainer` given, training on `device`),
    activation checkpointing and regional compile. Raises for a choice that cannot run here."""
    converters: list[ModelConverter] = [ExpertPath(moe_impl)]
    if trainer is not None:
        if trainer.activation_checkpointing:
            converters.append(ActivationCheckpointing())
        if trainer.compile_blocks:
            converters.append(CompileBlocks(torch.device(device)))
    return converters


def apply_converters(model: MoEForCausalLM, converters: Iterable[ModelConverter]) -> MoEForCausalLM:
    """Apply each converter to `model` in order; returns the model (converted in place)."""
    for converter in converters:
        converter.convert(model)
    return model
