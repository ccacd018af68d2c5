"""Typed configuration for every slipstream job: pydantic models with a docstring per field,
loaded from TOML and overridable from the command line (`--trainer.lr=3e-4`).

Imports without torch. `load_config(path, overrides)` fails with ConfigError naming key, value and
file before any work starts. `QUICKSTART` is the embedded job config (also `configs/quickstart.toml`
in the repository): what the CLI loads when no `-c FILE` is given.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from slipstream.config.base import ConfigError, Section, apply_overrides, load_model, parse_override
from slipstream.config.engine import EngineConfig
from slipstream.config.eval import EvalConfig
from slipstream.config.model import ModelConfig
from slipstream.config.rl import BufferConfig, RolloutConfig, StoreConfig, TrainerConfig
from slipstream.config.run import RunConfig
from slipstream.config.sandbox import SandboxConfig
from slipstream.config.sft import SFTConfig
from slipstream.config.task import TaskConfig

QUICKSTART = Path(__file__).with_name("quickstart.toml")


class SlipstreamConfig(Section):
    """The whole job. Every section has defaults (an empty file is valid); the embedded quickstart
    (`QUICKSTART`) sets the tiny model, task, SFT and RL recipe that `make run` runs."""

    run: RunConfig = Field(default_factory=RunConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    task: TaskConfig = Field(default_factory=TaskConfig)
    sft: SFTConfig = Field(default_factory=SFTConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    engine: EngineConfig = Field(default_factory=EngineConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    buffer: BufferConfig = Field(default_factory=BufferConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    store: StoreConfig = Field(default_factory=StoreConfig)
    sandbox: SandboxConfig = Field(default_factory=SandboxConfig)


def load_config(
    path: str | Path | None = None, overrides: list[str] | None = None
) -> SlipstreamConfig:
    """Load a job config from TOML (or the built-in defaults) plus dotted overrides."""
    return load_model(SlipstreamConfig, path, overrides)


__all__ = [
    "QUICKSTART",
    "ConfigError",
    "Section",
    "SlipstreamConfig",
    "apply_overrides",
    "load_config",
    "load_model",
    "parse_override",
]
