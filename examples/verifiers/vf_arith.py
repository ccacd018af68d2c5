"""A verifiers 0.4 (`verifiers.v1`) taskset written only against verifiers: two-digit
multiplications, scored by two weighted rewards. Nothing here knows slipstream; slipstream runs it
unchanged (docs/verifiers.md).

    uv run vf-eval vf_arith ...            # verifiers' own eval (with this folder on PYTHONPATH)
    slipstream run -c configs/verifiers.toml   # RL in slipstream

The episode reward is verifiers' own: `Trace.reward` = sum of score * weight over the rewards
(0.8 * correct + 0.2 * concise here).
"""

from __future__ import annotations

import random

import verifiers.v1 as vf


class ArithData(vf.TaskData):
    answer: str = ""
    """The exact product, as digits."""


class ArithTask(vf.Task[ArithData]):
    @vf.reward(weight=0.8)
    async def correct(self, task: ArithData, trace: vf.Trace) -> float:
        """1 when the last reply is exactly the product."""
        return float(trace.last_reply.strip() == task.answer)

    @vf.reward(weight=0.2)
    async def concise(self, task: ArithData, trace: vf.Trace) -> float:
        """1 when the last reply is no longer than the answer (no padding, no working)."""
        return float(len(trace.last_reply.strip()) <= len(task.answer))


class ArithTaskset(vf.Taskset[ArithTask]):
    NUM_TASKS = 5000
    SEED = 1234

    def load(self):
        rng = random.Random(self.SEED)
        for _ in range(self.NUM_TASKS):
            a, b = rng.randint(10, 99), rng.randint(2, 9)
            yield ArithTask(ArithData(prompt=f"{a}*{b}=", answer=str(a * b)))


__all__ = ["ArithTaskset"]
