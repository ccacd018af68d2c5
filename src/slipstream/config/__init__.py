"""Typed configuration for every slipstream job: pydantic models with a docstring per field,
loaded from TOML and overridable from the command line (`--trainer.lr=3e-4`).

Imports without torch. `load_config(path, overrides)` fails with ConfigError naming key, value and
file before any work starts. `QUICKSTART` is the embedded job config (also `configs/quickstart.toml`
in the repository): what the CLI loads when no `-c FILE` is given.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, model_validator

from slipstream.config.agent import AgentConfig
from slipstream.config.base import ConfigError, Section, apply_overrides, load_model, parse_override
from slipstream.config.engine import EngineConfig
from slipstream.config.eval import EvalConfig
from slipstream.config.model import ModelConfig
from slipstream.config.rl import BufferConfig, RolloutConfig, StoreConfig, TrainerConfig
from slipstream.config.rm import RewardConfig, RMConfig
from slipstream.config.run import RunConfig
from slipstream.config.sandbox import SandboxConfig
from slipstream.config.sft import SFTConfig
from slipstream.config.task import TaskConfig

QUICKSTART = Path(__file__).with_name("quickstart.toml")

_STALENESS_OF_MODE = {"sync": 0, "one_step_off": 1}  # "async" keeps the configured bound


def staleness_bound(mode: str, max_staleness: int) -> int:
    """The staleness bound a `trainer.mode` implies: "sync" 0, "one_step_off" 1, "async" the
    configured `buffer.max_staleness`. The one place this mapping lives (the job config and the
    planner's rates both resolve through it)."""
    return _STALENESS_OF_MODE.get(mode, max_staleness)


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
    rm: RMConfig = Field(default_factory=RMConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    agent: AgentConfig = Field(default_factory=AgentConfig)

    @model_validator(mode="after")
    def _resolve_derived(self) -> SlipstreamConfig:
        """Settings that follow from others, resolved once here so no code derives (or
        mutates) them later; `slipstream config show` prints the resolved values.

        - `buffer.max_staleness` is the one staleness bound: `trainer.mode` = "sync" sets it to 0,
          "one_step_off" to 1; "async" keeps the configured value.
        - `trainer.deterministic` needs `trainer.mode = "sync"` and turns on `rollout.seeded`.
        - `trainer.routing_replay = "r3"` turns on `rollout.record_routing`.
        - `store.url` empty -> `<run.output_dir>/store` as an absolute path, so every process of
          the job (rollout workers, trainer ranks) opens the same store whatever its directory.
        - `task.max_prompt_tokens` 0 -> the model's context minus the completion cap.
        - `trainer.parallel.dp_replicate` 0 -> num_processes / (dp_shard x ep); the layout is
          checked against trainer.num_processes and model.num_experts.
        """
        bound = staleness_bound(self.trainer.mode, self.buffer.max_staleness)
        if self.buffer.max_staleness != bound:
            self.buffer.max_staleness = bound
        if self.trainer.deterministic:
            if self.trainer.mode != "sync":
                raise ValueError(
                    f"trainer.deterministic needs trainer.mode = 'sync' (got "
                    f"{self.trainer.mode!r}): in the other modes which weights produced which "
                    "tokens depends on timing"
                )
            if not self.rollout.seeded:
                self.rollout.seeded = True
        if self.trainer.routing_replay == "r3" and not self.rollout.record_routing:
            self.rollout.record_routing = True
        if not self.store.url:
            self.store.url = str(Path(self.run.output_dir).resolve() / "store")
        if self.task.max_prompt_tokens == 0:
            completion = self.rollout.max_new_tokens or self.engine.max_new_tokens
            self.task.max_prompt_tokens = max(1, self.model.max_position_embeddings - completion)
        if self.sft.min_pass_at_1 > 0:
            need = self.eval.num_prompts + self.sft.val_prompts
            if self.task.num_heldout < need:
                raise ValueError(
                    f"sft.min_pass_at_1 validates on held-out tasks past the reported ones: "
                    f"task.num_heldout = {self.task.num_heldout} must be >= eval.num_prompts + "
                    f"sft.val_prompts = {need}"
                )
        if self.reward.server == "ray_actor" and self.run.launcher != "ray":
            raise ValueError(
                f"reward.server = 'ray_actor' needs run.launcher = 'ray' (got "
                f"{self.run.launcher!r})"
            )
        # The layout against the model it splits (a start checkpoint's own architecture is
        # checked again when it loads, launch/dp.py).
        self.trainer.parallel.check(self.trainer.num_processes, self.model.num_experts)
        return self


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
    "staleness_bound",
]
