"""Verifier: how a rollout worker scores completions. One interface, whether the task's verifier
runs in-process or in a sandbox from the worker's pool.

`verify(task, completion_text) -> (reward, reason)` may block (sandboxes, test suites); the worker
calls it from a thread pool. It must return for any completion text: a verifier that raises would
leave its group neither acked nor nacked.

- `InProcessVerifier`: the task set's own `verify` (arithmetic, countdown: they parse numbers and
  never execute model output).
- `SandboxVerifier`: the task set's `averify(task, completion, sandbox)` (the `code` task) with a
  sandbox acquired from a `SandboxPool` per call (single use by default). The pool lives on one
  event loop in a background thread owned by the verifier: `start()` ... `close()`.
- `make_verifier(cfg, taskset)` picks one by `sandbox.verify_in_sandbox`.
- `LatencyInjector` wraps any verifier with an artificial delay drawn from a heavy-tailed
  distribution, for the pipeline benchmark (the delay is recorded, not hidden).
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import logging
import math
import random
import threading
import time
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from slipstream.tasks import Task, TaskSet

if TYPE_CHECKING:
    from slipstream.config.sandbox import SandboxConfig
    from slipstream.sandbox import PoolOptions, PoolStats, SandboxPool, SandboxTemplate

log = logging.getLogger(__name__)

# z-score of the 99th percentile of a standard normal: p99/p50 of a lognormal is exp(Z99 * sigma).
Z99 = 2.3263478740408408


class Verifier(Protocol):
    def verify(self, task: Task, completion: str) -> tuple[float, str]:
        """Reward in [0, 1] and a short reason. Must not raise on any completion text."""
        ...

    def close(self) -> None:
        """Release what the verifier holds (a sandbox pool: every sandbox, cgroup and journal
        entry); call once, after the last verify returned."""
        ...


class InProcessVerifier:
    """Calls the task set's own verifier in this process (no isolation: the built-in arithmetic
    and countdown verifiers parse numbers and never execute model output)."""

    def __init__(self, taskset: TaskSet) -> None:
        self.taskset = taskset

    def verify(self, task: Task, completion: str) -> tuple[float, str]:
        verdict = self.taskset.verify(task, completion)
        return float(verdict.reward), verdict.reason

    def close(self) -> None:
        """Nothing to release."""


def has_sandboxed_verifier(taskset: TaskSet) -> bool:
    """Whether the task set verifies inside a sandbox (exposes `averify(task, completion, sb)`)."""
    return callable(getattr(taskset, "averify", None))


def wants_sandbox(mode: str, taskset: TaskSet) -> bool:
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


def _percentile(samples: list[float], q: float) -> float | None:
    if not samples:
        return None
    s = sorted(samples)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


class SandboxVerifier:
    """The task set's `averify` in a sandbox from a `SandboxPool`, callable from any thread.

    Contract:
    - `start()` runs one asyncio event loop in a daemon thread, starts the pool there (reaping
      journal orphans of dead owners) and waits until `min_idle` sandboxes are warm; a backend that
      cannot create sandboxes fails here, loudly, not on the first verification.
    - `verify(task, completion)` submits acquire -> `averify` -> release to that loop
      (`asyncio.run_coroutine_threadsafe`) and blocks for the verdict. Whatever the completion
      does (loops, kills its sandbox, floods output) is a verdict from the task set. An
      infrastructure failure (no sandbox within `acquire_timeout_s`, the pool stopped, the whole
      call past `verify_timeout_s`) returns reward 0 with a "verifier failure" reason, is logged and
      counted in `counts["infra_failures"]`; it never raises.
    - `close()` (idempotent; also registered with atexit) stops the pool — every sandbox, idle or
      in use, is destroyed, no process, cgroup or journal entry is left — then stops the loop.
      Verifications still running then end with a verifier failure.

    Not covered: sharing one pool between verifiers or processes (each worker owns its pool and
    admits against the whole host), retrying a verification after an infrastructure failure.
    """

    def __init__(
        self,
        taskset: TaskSet,
        template: SandboxTemplate,
        options: PoolOptions | None = None,
        *,
        state_dir: str | Path | None = None,
        ready_timeout_s: float = 60.0,
        verify_timeout_s: float | None = None,
    ) -> None:
        from slipstream.sandbox import PoolOptions

        if not has_sandboxed_verifier(taskset):
            raise ValueError(f"task {taskset.name!r} has no sandboxed verifier (averify)")
        self.taskset = taskset
        self.template = template
        self.options = options or PoolOptions()
        self.state_dir = state_dir
        self.ready_timeout_s = ready_timeout_s
        # acquire may wait acquire_timeout_s; the code verifier's exec has its own timeout (10 s)
        # plus the host's 5 s grace for a hung agent; the rest is margin for a loaded host.
        self.verify_timeout_s = verify_timeout_s or (
            self.options.acquire_timeout_s + template.exec_timeout_s + 30.0
        )
        self.counts = {"verified": 0, "infra_failures": 0}
        self._latency_s: deque[float] = deque(maxlen=100_000)
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._pool: SandboxPool | None = None
        self._closed = False

    # ---- lifecycle -----------------------------------------------------------------------------

    def start(self) -> SandboxVerifier:
        if self._loop is not None or self._closed:
            raise RuntimeError("SandboxVerifier.start() may be called once")
        loop = asyncio.new_event_loop()
        thread = threading.Thread(
            target=self._run_loop, args=(loop,), daemon=True, name="sandbox-verifier"
        )
        thread.start()
        self._loop, self._thread = loop, thread
        atexit.register(self.close)
        try:
            fut = asyncio.run_coroutine_threadsafe(self._start_pool(), loop)
            fut.result(timeout=self.ready_timeout_s + 30.0)
        except BaseException:
            self.close()
            raise
        return self

    @staticmethod
    def _run_loop(loop: asyncio.AbstractEventLoop) -> None:
        asyncio.set_event_loop(loop)
        try:
            loop.run_forever()
        finally:
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    async def _start_pool(self) -> None:
        from slipstream.sandbox import SandboxError, SandboxPool

        pool = SandboxPool(self.template, self.options, state_dir=self.state_dir)
        self._pool = pool  # before start(): close() must stop a half-started pool too
        await pool.start()
        if pool.orphans_reaped:
            log.warning("sandbox verifier: reaped %d orphaned sandboxes", pool.orphans_reaped)
        if self.options.min_idle:
            try:
                await pool.wait_ready(self.ready_timeout_s)
            except TimeoutError:
                raise SandboxError(
                    f"sandbox verifier: no warm {self.template.backend} sandbox within "
                    f"{self.ready_timeout_s} s ({pool.stats()}); see `slipstream sandbox doctor`"
                ) from None

    def close(self, timeout_s: float = 60.0) -> None:
        """Stop the pool (nothing left behind) and the loop. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        atexit.unregister(self.close)
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        try:
            if loop.is_running():
                asyncio.run_coroutine_threadsafe(self._stop_pool(), loop).result(timeout_s)
        finally:
            if not loop.is_closed():
                loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout_s)
        if thread.is_alive():
            log.error("sandbox verifier: event loop thread did not stop within %s s", timeout_s)

    async def _stop_pool(self) -> None:
        if self._pool is not None:
            await self._pool.stop()
        # Verifications still in flight (their sandboxes are gone now): cancel them so that their
        # callers get a verdict instead of waiting for verify_timeout_s.
        me = asyncio.current_task()
        rest = [t for t in asyncio.all_tasks() if t is not me]
        for t in rest:
            t.cancel()
        await asyncio.gather(*rest, return_exceptions=True)

    def __enter__(self) -> SandboxVerifier:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- verification --------------------------------------------------------------------------

    async def _averify(self, task: Task, completion: str) -> tuple[float, str]:
        from slipstream.sandbox import SandboxError

        pool = self._pool
        assert pool is not None
        sb = await pool.acquire()
        try:
            verdict = await self.taskset.averify(task, completion, sb)  # type: ignore[attr-defined]
        finally:
            # after a concurrent stop() the sandbox is already destroyed: nothing to give back
            with contextlib.suppress(SandboxError):
                await pool.release(sb)
        return float(verdict.reward), verdict.reason

    def verify(self, task: Task, completion: str) -> tuple[float, str]:
        from slipstream.sandbox import SandboxError
        from slipstream.sandbox.pinning import NoCpusFree

        t0 = time.perf_counter()
        fut = None
        with self._lock:  # no submission can race close(): it sets _closed under this lock
            if not (self._closed or self._loop is None or self._pool is None):
                fut = asyncio.run_coroutine_threadsafe(self._averify(task, completion), self._loop)
        if fut is None:
            return self._infra_failure("sandbox verifier is not running")
        try:
            reward, reason = fut.result(timeout=self.verify_timeout_s)
        except TimeoutError:
            fut.cancel()
            return self._infra_failure(f"no verdict within {self.verify_timeout_s:g} s")
        except concurrent.futures.CancelledError:
            return self._infra_failure("cancelled by close()")
        except (SandboxError, OSError, NoCpusFree) as e:
            return self._infra_failure(f"{type(e).__name__}: {e}")
        with self._lock:
            self.counts["verified"] += 1
            self._latency_s.append(time.perf_counter() - t0)
        return reward, reason

    def _infra_failure(self, why: str) -> tuple[float, str]:
        with self._lock:
            self.counts["infra_failures"] += 1
            n = self.counts["infra_failures"]
        if n <= 3 or n % 100 == 0:  # loud but bounded: a broken pool fails every call
            log.error("sandbox verifier failure #%d (reward 0 recorded): %s", n, why)
        return 0.0, f"verifier failure: {why[:200]}"

    # ---- observation ---------------------------------------------------------------------------

    def stats(self) -> PoolStats | None:
        """The pool's stats (None before start)."""
        pool, loop = self._pool, self._loop
        if pool is None or loop is None:
            return None
        if loop.is_running() and not self._closed:

            async def read() -> PoolStats:
                return pool.stats()

            return asyncio.run_coroutine_threadsafe(read(), loop).result(10.0)
        return pool.stats()

    def summary(self) -> dict[str, Any]:
        """Counts and verify latency (wall time of `verify`, acquire included) p50/p99."""
        with self._lock:
            lat = list(self._latency_s)
            out: dict[str, Any] = dict(self.counts)
        out["latency_p50_s"] = _percentile(lat, 0.5)
        out["latency_p99_s"] = _percentile(lat, 0.99)
        st = self.stats()
        if st is not None:
            out.update(acquires=st.acquires, created=st.created, destroyed=st.destroyed,
                       live=st.live)  # fmt: skip
        return out


def make_verifier(
    sandbox_cfg: SandboxConfig, taskset: TaskSet
) -> InProcessVerifier | SandboxVerifier:
    """The verifier `sandbox.verify_in_sandbox` selects for this task set, started."""
    if not wants_sandbox(sandbox_cfg.verify_in_sandbox, taskset):
        return InProcessVerifier(taskset)
    from slipstream.sandbox import PoolOptions, SandboxTemplate

    verifier = SandboxVerifier(
        taskset,
        SandboxTemplate.from_config(sandbox_cfg),
        PoolOptions.from_config(sandbox_cfg),
        state_dir=sandbox_cfg.state_dir,
        ready_timeout_s=sandbox_cfg.create_timeout_s,
    )
    return verifier.start()


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

    def close(self) -> None:
        self.inner.close()
