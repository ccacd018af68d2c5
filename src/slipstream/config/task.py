"""`[task]`: which built-in verifiable task, and how its splits are generated."""

from typing import Literal

from pydantic import Field

from slipstream.config.base import Section


class TaskConfig(Section):
    name: Literal["arithmetic", "countdown", "code"] = "arithmetic"
    """Built-in task: multi-digit arithmetic, Countdown, or sandboxed code problems."""
    seed: int = Field(default=1234, ge=0)
    """Seed of the task generator (train and held-out splits are disjoint for a seed)."""
    num_train: int = Field(default=20000, ge=1)
    """Training prompts."""
    num_heldout: int = Field(default=200, ge=1)
    """Held-out prompts for evaluation."""
    max_digits: int = Field(default=3, ge=1, le=18)
    """Arithmetic: operands have up to this many digits."""
