"""`[task]`: which built-in verifiable task, and how its splits are generated."""

from typing import Literal

from pydantic import Field, model_validator

from slipstream.config.base import Section


class TaskConfig(Section):
    name: Literal["arithmetic", "countdown", "code", "tool_arithmetic"] = "arithmetic"
    """Built-in task: multi-digit arithmetic, Countdown, sandboxed code problems, or arithmetic
    whose teacher sometimes uses the `<py>` tool (`tool_arithmetic`, for `env = "python_tool"`)."""
    env: Literal["single_turn", "python_tool", "code_tests", "agent"] = "single_turn"
    """Rollout environment (slipstream.envs, docs/envs.md): `single_turn` (the prompt, one
    completion, the verifier's reward), `python_tool` (the policy may run `<py>...</py>` programs
    in the episode's sandbox before it answers), `code_tests` (the `code` task, revised against
    visible tests run in the episode's sandbox). Environments with sandboxes use [sandbox]."""
    seed: int = Field(default=1234, ge=0)
    """Seed of the task generator (train and held-out splits are disjoint for a seed)."""
    num_train: int = Field(default=20000, ge=1)
    """Training prompts (train indices wrap around at this count)."""
    num_heldout: int = Field(default=200, ge=1)
    """Held-out prompts for evaluation."""
    heldout_fraction: float = Field(default=0.1, gt=0, lt=1)
    """Share of the problem-key space reserved for the held-out split (by keyed hash)."""
    tokenizer: str = "char"
    """`char` (built-in character vocabulary), or a path to a tokenizer.json / a directory holding one."""
    max_digits: int = Field(default=2, ge=1, le=18)
    """Arithmetic: operands have up to this many digits."""
    min_digits: int = Field(default=1, ge=1, le=18)
    """Arithmetic: operands have at least this many digits (digit count is uniform in the range)."""
    ops: list[Literal["+", "-", "*"]] = Field(default_factory=lambda: ["+", "-", "*"], min_length=1)
    """Arithmetic: operators to draw from (uniformly)."""
    demo_drop_carry: float = Field(default=0.0, ge=0, le=1)
    """Arithmetic: share of `+`/`-` problems needing a carry or borrow whose SFT demonstration drops
    it (digit-wise, as a weak teacher does: 57+68 -> "15"). Simulates demonstrations from an
    imperfect teacher; the verifier, rewards and evaluation stay exact. 0 = perfect demonstrations."""
    demo_tool_use: float = Field(default=0.0, ge=0, le=1)
    """tool_arithmetic: share of problems (a keyed hash of the problem) whose SFT demonstration
    runs the answer through the `<py>` tool (`<py>a*b</py>`, its output, the answer); the rest
    answer without it (see demo_tool_min_lead). The imperfect teacher of configs/agentic.toml."""
    demo_tool_min_lead: int = Field(default=10, ge=1, le=10)
    """tool_arithmetic: the teacher always uses the tool when the first operand's leading digit
    is at least this (10 = never by this rule; only demo_tool_use's share)."""
    countdown_numbers: int = Field(default=4, ge=2, le=5)
    """Countdown: how many numbers are given (the demonstration solver is exhaustive, hence <= 5)."""
    countdown_max_number: int = Field(default=20, ge=2, le=1000)
    """Countdown: given numbers are drawn from 1..this."""
    countdown_max_target: int = Field(default=100, ge=2, le=100000)
    """Countdown: targets are in 1..this."""

    @model_validator(mode="after")
    def _digits_ordered(self) -> "TaskConfig":
        if self.min_digits > self.max_digits:
            raise ValueError(
                f"task.min_digits ({self.min_digits}) must be <= task.max_digits ({self.max_digits})"
            )
        return self
