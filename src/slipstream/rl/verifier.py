"""Verifier: how a rollout worker scores completions. One interface, so the task's in-process
verifier can later be swapped for the sandbox pool without touching the worker.

`verify(task, completion_text) -> (reward, reason)` may block (sandboxes, test suites); the worker
calls it from a thread pool. `LatencyInjector` wraps any verifier with an artificial delay drawn
from a heavy-tailed distribution, for the pipeline benchmark (the delay is recorded, not hidden).
"""

from __future__ import annotations

import math
import random
import threading
import time
from typing import Protocol

from slipstream.tasks import Task, TaskSet

# z-score of the 99th percentile of a standard normal: p99/p50 of a lognormal is exp(Z99 * sigma).
Z99 = 2.3263478740408408


class Verifier(Protocol):
    def verify(self, task: Task, completion: str) -> tuple[float, str]:
        """Reward in [0, 1] and a short reason. Must not raise on any completion text."""
        ...


class InProcessVerifier:
    """Calls the task set's own verifier in this process (no isolation: the built-in arithmetic
    and countdown verifiers parse numbers and never execute model output)."""

    def __init__(self, taskset: TaskSet) -> None:
        self.taskset = taskset

    def verify(self, task: Task, completion: str) -> tuple[float, str]:
        verdict = self.taskset.verify(task, completion)
        return float(verdict.reward), verdict.reason


def lognormal_sigma(p99_over_p50: float) -> float:
    """sigma of a lognormal whose p99/p50 is the given ratio."""
    if p99_over_p50 < 1:
        raise ValueError(f"p99/p50 must be >= 1, got {p99_over_p50}")
    return math.log(p99_over_p50) / Z99


class LatencyInjector:
    """Adds a lognormal delay (median p50_s, p99/p50 = ratio) before each verification."""

    def __init__(self, inner: Verifier, p50_s: float, p99_over_p50: float, seed: int = 0) -> None:
        self.inner = inner
        self.p50_s = p50_s
        self.sigma = lognormal_sigma(p99_over_p50)
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self.total_delay_s = 0.0

    def draw_s(self) -> float:
        with self._lock:
            d = self.p50_s * math.exp(self.sigma * self._rng.gauss(0.0, 1.0))
            self.total_delay_s += d
            return d

    def verify(self, task: Task, completion: str) -> tuple[float, str]:
        time.sleep(self.draw_s())
        return self.inner.verify(task, completion)
