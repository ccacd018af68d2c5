"""Verifier: how a rollout worker scores answers. One interface, whether the task's verifier
runs in-process or in a sandbox from the worker's pool; the worker's environments call it
(`slipstream.envs`: the single-turn environment scores its one completion with it, the tool
environment its final answer).

`verify(task, completion_text) -> (reward, reason)` may block (sandboxes, test suites); it is
called from the worker's thread pool. For anything the completion does it returns a reward;
for an infrastructure failure (no sandbox in time, the pool stopped, no verdict in time) it
raises `InfraError`, which is never turned into a reward: the episode is re-run, or its task
dropped (rl/worker.py).

- `InProcessVerifier`: the task set's own `verify` (arithmetic, countdown: they parse numbers and
  never execute model output).
- `SandboxVerifier`: the task set's `averify(task, completion, sandbox)` (the `code` task) with a
  sandbox acquired from a `SandboxHost` (a pool on an event loop in a background thread) per
  call (single use by default): `start()` ... `close()`.
- `verifier.sandboxes`: the SandboxHost the worker's environments take their sandboxes from
  (the same pool; None when nothing of the task needs one). The verifier owns it: `close()`
  stops it.
- `make_verifier(cfg, taskset)` picks one by `sandbox.verify_in_sandbox` and `task.env`; the
  worker's reward is then `rm/source.py: make_reward_source` over it: this verifier alone, or a
  `RewardSet` (slipstream/rewards: `[[reward.functions]]`) with it as the "verifier" kind.
- `LatencyInjector` wraps any verifier with an artificial delay drawn from a heavy-tailed
  distribution, for the pipeline benchmark (the delay is recorded, not hidden).
"""

from __future__ import annotations

import logging
import math
import random
import threading
import time
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from slipstream.envs import InfraError, env_needs_sandbox
from slipstream.envs.base import Score
from slipstream.envs.sandboxes import SandboxHost
from slipstream.sandbox.pool import percentile
from slipstream.tasks import SandboxedTaskSet, Task, TaskSet

if TYPE_CHECKING:
    from slipstream.config.sandbox import SandboxConfig
    from slipstream.sandbox import PoolOptions, PoolStats, SandboxTemplate

log = logging.getLogger(__name__)

# z-score of the 99th percentile of a standard normal: p99/p50 of a lognormal is exp(Z99 * sigma).
Z99 = 2.3263478740408408


class Verifier(Protocol):
    sandboxes: SandboxHost | None
    """The sandbox host of the worker's episodes (owned by the verifier), or None."""

    def verify(self, task: Task, completion: str) -> tuple[float, str]:
        """Reward and a short reason for any completion text (a `Score` carrying the reward's
        components for a `RewardSet`); InfraError (never a reward) when the infrastructure
        failed, RewardDropped when a reward function gave none."""
        ...

    def score_group(self, task: Task, completions: list[str]) -> list[Score] | None:
        """Rewards added to a finished group's episodes (`group = true` reward functions), one
        per completion; None when nothing scores groups."""
        ...

    def reward_stats(self) -> dict[str, float]:
        """Counters of the reward functions (`reward_<name>_<counter>`; {} for a verifier
        alone): the worker reports them."""
        ...

    def close(self) -> None:
        """Release what the verifier holds (a sandbox pool: every sandbox, cgroup and journal
        entry); call once, after the last verify returned."""
        ...


class InProcessVerifier:
    """Calls the task set's own verifier in this process (no isolation: the built-in arithmetic
    and countdown verifiers parse numbers and never execute model output). `sandboxes`: a started
    host for the task's environment (tool runs), closed by `close()`."""

    def __init__(self, taskset: TaskSet, sandboxes: SandboxHost | None = None) -> None:
        self.taskset = taskset
        self.sandboxes = sandboxes

    def verify(self, task: Task, completion: str) -> tuple[float, str]:
        verdict = self.taskset.verify(task, completion)
        return float(verdict.reward), verdict.reason

    def score_group(self, task: Task, completions: list[str]) -> list[Score] | None:
        return None

    def reward_stats(self) -> dict[str, float]:
        return {}

    def close(self) -> None:
        if self.sandboxes is not None:
            self.sandboxes.close()


def has_sandboxed_verifier(taskset: TaskSet) -> bool:
    """Whether the task set verifies inside a sandbox (a `SandboxedTaskSet`: `averify(task,
    completion, sb)`)."""
    return isinstance(taskset, SandboxedTaskSet)


def verifies_in_sandbox(mode: str, taskset: TaskSet) -> bool:
    """`sandbox.verify_in_sandbox` resolved for a task set: auto = when it has a sandboxed verifier
    (it executes model output); always = required (ValueError naming the task when it has none)."""
    if mode == "never":
        return False
    if mode == "auto":
        return has_sandboxed_verifier(taskset)
    if mode == "always":
        if not has_sandboxed_verifier(taskset):
            raise ValueError(
                f"sandbox.verify_in_sandbox=always, but task {taskset.name!r} has no sandboxed "
                "verifier (no averify); use auto or never"
            )
        return True
    raise ValueError(f"sandbox.verify_in_sandbox must be auto, always or never, got {mode!r}")


def wants_sandbox(mode: str, taskset: TaskSet) -> bool:
    """Whether the worker needs a sandbox pool: it verifies in a sandbox (`verifies_in_sandbox`)
    or the task's environment (`task.env`) gives every episode a sandbox."""
    return verifies_in_sandbox(mode, taskset) or env_needs_sandbox(taskset.cfg.env)


class SandboxVerifier:
    """The task set's `averify` in a sandbox from a `SandboxHost`, callable from any thread.

    Contract:
    - `start()` starts the host (loop thread + pool, reaping journal orphans of dead owners) and
      waits until `min_idle` sandboxes are warm; a backend that cannot create sandboxes fails
      here, loudly, not on the first verification.
    - `verify(task, completion)` acquires a sandbox, runs `averify` in it, releases it, and
      returns the verdict. Whatever the completion does (loops, kills its sandbox, floods
      output) is a verdict from the task set. An infrastructure failure (no sandbox within
      `acquire_timeout_s`, the host stopped, no verdict within `verify_timeout_s`) raises
      InfraError, is logged (bounded) and counted in `counts["infra_failures"]`.
    - `close()` (idempotent) stops the host — every sandbox, idle or in use, is destroyed, no
      process, cgroup or journal entry is left. Verifications still running then raise
      InfraError.

    Not covered: sharing one pool between processes (each worker owns its host and admits
    against the whole host), retrying inside verify (the episode runner re-runs the episode).
    """

    def __init__(
        self,
        taskset: TaskSet,
        template: SandboxTemplate | None = None,
        options: PoolOptions | None = None,
        *,
        state_dir: str | Path | None = None,
        ready_timeout_s: float = 60.0,
        verify_timeout_s: float | None = None,
        host: SandboxHost | None = None,
    ) -> None:
        """A private pool of `template` sandboxes, or the given (not started) `host`."""
        if not isinstance(taskset, SandboxedTaskSet):
            raise ValueError(f"task {taskset.name!r} has no sandboxed verifier (averify)")
        if host is None:
            if template is None:
                raise ValueError("SandboxVerifier needs a template or a host")
            host = SandboxHost(template, options, state_dir=state_dir,
                               ready_timeout_s=ready_timeout_s)  # fmt: skip
        self.taskset: SandboxedTaskSet = taskset
        self.template = host.template
        self.sandboxes: SandboxHost | None = host
        self.options = host.options
        # the code verifier's exec has its own timeout (10 s) plus the host's 5 s grace for a
        # hung agent; the rest is margin for a loaded host
        self.verify_timeout_s = verify_timeout_s or (self.template.exec_timeout_s + 30.0)
        self.counts = {"verified": 0, "infra_failures": 0}
        self._latency_s: deque[float] = deque(maxlen=100_000)
        self._lock = threading.Lock()

    # ---- lifecycle -----------------------------------------------------------------------------

    def start(self) -> SandboxVerifier:
        assert self.sandboxes is not None
        self.sandboxes.start()
        return self

    def close(self, timeout_s: float = 60.0) -> None:
        """Stop the host (nothing left behind). Idempotent."""
        if self.sandboxes is not None:
            self.sandboxes.close(timeout_s)

    def __enter__(self) -> SandboxVerifier:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- verification --------------------------------------------------------------------------

    def verify(self, task: Task, completion: str) -> tuple[float, str]:
        host = self.sandboxes
        assert host is not None
        t0 = time.perf_counter()
        try:
            held = host.acquire()
            try:
                verdict = held.run(
                    lambda sb: self.taskset.averify(task, completion, sb),
                    self.verify_timeout_s, "sandboxed verification",
                )  # fmt: skip
            finally:
                held.release()
        except InfraError as e:
            with self._lock:
                self.counts["infra_failures"] += 1
                n = self.counts["infra_failures"]
            if n <= 3 or n % 100 == 0:  # loud but bounded: a broken pool fails every call
                log.error("sandbox verifier: infrastructure failure #%d (no reward): %s", n, e)
            raise
        with self._lock:
            self.counts["verified"] += 1
            self._latency_s.append(time.perf_counter() - t0)
        return float(verdict.reward), verdict.reason

    def score_group(self, task: Task, completions: list[str]) -> list[Score] | None:
        return None

    def reward_stats(self) -> dict[str, float]:
        return {}

    # ---- observation ---------------------------------------------------------------------------

    def stats(self) -> PoolStats | None:
        """The pool's stats (None before start)."""
        return self.sandboxes.stats() if self.sandboxes is not None else None

    def summary(self) -> dict[str, Any]:
        """Counts and verify latency (wall time of `verify`, acquire included) p50/p99."""
        with self._lock:
            lat = list(self._latency_s)
            out: dict[str, Any] = dict(self.counts)
        out["latency_p50_s"] = percentile(lat, 0.5)
        out["latency_p99_s"] = percentile(lat, 0.99)
        st = self.stats()
        if st is not None:
            out.update(acquires=st.acquires, created=st.created, destroyed=st.destroyed,
                       live=st.live)  # fmt: skip
        return out


def make_verifier(
    sandbox_cfg: SandboxConfig, taskset: TaskSet, agent_url: str = ""
) -> InProcessVerifier | SandboxVerifier:
    """The verifier for this task set, started: `sandbox.verify_in_sandbox` decides where
    answers are verified; a task whose environment (`task.env`) gives episodes sandboxes gets a
    started SandboxHost in `verifier.sandboxes` either way (the sandbox verifier's own).
    `agent_url` (`rollout.sandbox_agent`): lease the sandboxes from the node's host agent
    instead of a private pool."""
    if verifies_in_sandbox(sandbox_cfg.verify_in_sandbox, taskset):
        return SandboxVerifier(
            taskset, host=SandboxHost.from_config(sandbox_cfg, agent_url)
        ).start()
    if env_needs_sandbox(taskset.cfg.env):
        return InProcessVerifier(taskset, SandboxHost.from_config(sandbox_cfg, agent_url).start())
    return InProcessVerifier(taskset)


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
        self.sandboxes = inner.sandboxes

    def draw_s(self) -> float:
        with self._lock:
            d = self.p50_s * math.exp(self.sigma * self._rng.gauss(0.0, 1.0))
            self.total_delay_s += d
            return d

    def verify(self, task: Task, completion: str) -> tuple[float, str]:
        time.sleep(self.draw_s())
        return self.inner.verify(task, completion)

    def score_group(self, task: Task, completions: list[str]) -> list[Score] | None:
        return self.inner.score_group(task, completions)

    def reward_stats(self) -> dict[str, float]:
        return self.inner.reward_stats()

    def close(self) -> None:
        self.inner.close()
