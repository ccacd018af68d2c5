"""`[rollout]`, `[buffer]`, `[trainer]`, `[store]`: the asynchronous RL loop."""

from typing import Literal

from pydantic import Field

from slipstream.config.base import Section


class RolloutConfig(Section):
    num_workers: int = Field(default=1, ge=1)
    """Rollout worker processes."""
    group_size: int = Field(default=8, ge=1)
    """G: samples per task (GRPO group)."""
    temperature: float = Field(default=1.0, ge=0)
    """Sampling temperature for rollouts."""
    tasks_per_lease: int = Field(default=4, ge=1)
    """Tasks leased at once by a worker."""
    lease_ttl_s: float = Field(default=60.0, gt=0)
    """A lease not acked or extended within this time is redelivered."""
    drain_timeout_s: float = Field(default=20.0, ge=0)
    """On SIGTERM, in-flight work may finish within this time; the rest is nacked."""


class BufferConfig(Section):
    max_staleness: int = Field(default=2, ge=0)
    """Most policy versions a trained token may lag the trainer (0 = on-policy / sync)."""


class TrainerConfig(Section):
    mode: Literal["sync", "one_step_off", "async"] = "async"
    """`sync`: generate then train; `one_step_off`: staleness 1; `async`: bounded by max_staleness."""
    steps: int = Field(default=60, ge=0)
    """RL optimizer steps."""
    groups_per_step: int = Field(default=8, ge=1)
    """Groups (tasks) per training batch."""
    lr: float = Field(default=1e-4, gt=0)
    """Peak learning rate (AdamW)."""
    loss: Literal["grpo", "ppo"] = "grpo"
    """Policy-gradient objective."""


class StoreConfig(Section):
    url: str = ""
    """Where weights and checkpoints go: a path, file://..., or s3://bucket/prefix. Empty means
    <run.output_dir>/store."""
    keep_last: int = Field(default=3, ge=1)
    """Weight versions kept."""
