"""`single_turn` (the default `task.env`): a task set's prompt, one model turn, the verifier's
reward. Every built-in task (arithmetic, countdown, code) runs through it: the same episode loop
as the multi-turn environments, with one step.

- `reset(task)` -> `taskset.prompt_ids(task)`; no stop strings (a turn ends at EOS or the token
  cap, exactly as a single completion did).
- `step(action_ids)` -> no observation, the scorer's reward on the decoded action, done.
  The scorer is the worker's Verifier (in-process, or the code task's sandbox verifier); its
  InfraError propagates (the episode is re-run; never a reward).
- `demonstration(task)` -> the task set's demonstration + EOS, all trained (the SFT target as
  it always was).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from slipstream.envs.base import (
    Demonstration,
    EnvUsage,
    EpisodeLimits,
    Scorer,
    StepResult,
    score_components,
)
from slipstream.tasks import Task, TaskSet

if TYPE_CHECKING:
    from slipstream.envs.sandboxes import SandboxHost


def taskset_scorer(taskset: TaskSet) -> Scorer:
    """The task set's own verifier as a Scorer (in-process; the code task's makes a sandbox per
    call)."""

    def score(task: Task, text: str) -> tuple[float, str]:
        verdict = taskset.verify(task, text)
        return float(verdict.reward), verdict.reason

    return score


class SingleTurnEnv:
    stop: tuple[str, ...] = ()
    needs_sandbox = False

    def __init__(self, taskset: TaskSet, *, scorer: Scorer | None = None,
                 sandboxes: SandboxHost | None = None,
                 limits: EpisodeLimits | None = None) -> None:  # fmt: skip
        self.taskset = taskset
        self.scorer = scorer or taskset_scorer(taskset)
        self.usage = EnvUsage()
        self._task: Task | None = None

    def reset(self, task: Task) -> list[int]:
        self._task = task
        return self.taskset.prompt_ids(task)

    def step(self, action_ids: Sequence[int], *, last: bool) -> StepResult:
        if self._task is None:
            raise RuntimeError("SingleTurnEnv.step before reset")
        score = self.scorer(self._task, self.taskset.tokenizer.decode(action_ids))
        reward, reason = score
        return StepResult([], float(reward), True, reason, score_components(score))

    def demonstration(self, task: Task) -> Demonstration:
        return Demonstration(
            self.taskset.prompt_ids(task),
            self.taskset.completion_ids(self.taskset.demonstration(task)),
        )

    def close(self) -> None:
        """Nothing held."""

    def info(self) -> dict[str, Any]:
        return {}
