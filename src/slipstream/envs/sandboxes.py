"""Sandboxes for episodes and verifiers, callable from any thread: a pool on an event loop of its
own.

    host = SandboxHost(template, options, state_dir=...).start()   # loop thread + warm pool
    held = host.acquire()              # one sandbox, kept by the caller (an episode) until release
    result = held.exec(["python3", "cell0.py"], files={"cell0.py": code}, timeout_s=10)
    verdict = held.run(lambda sb: taskset.averify(task, text, sb), timeout_s=60)
    held.release()                     # back to the pool: destroyed, or reset with sandbox.reuse
    host.close()                       # every sandbox destroyed, loop stopped

Contract:
- `start()` runs one asyncio loop in a daemon thread and starts the pool there (reaping journal
  orphans of dead owners), waiting for `min_idle` warm sandboxes: a backend that cannot create
  sandboxes fails here, loudly, not in the first episode.
- Every call that can fail for infrastructure reasons raises `InfraError` (never SandboxError):
  no sandbox within the acquire timeout, the pool or host stopped, a sandbox that died (the
  guest agent is gone: SandboxBroken), no answer within the call's timeout. A command that
  fails, loops or floods output is an `ExecResult`, not an error.
- `release()` is idempotent and never raises (a sandbox the pool already destroyed, e.g. after
  `close()`, is simply gone).
- `close()` (idempotent, also an atexit hook) stops the pool: every sandbox, idle or held, is
  destroyed; no process, cgroup or journal entry is left; held sandboxes answer InfraError.

The pool is a `sandbox.Pool` built on the loop by the pool factory (`sandbox.open_pool`): an
in-process `SandboxPool(template, options, state_dir=...)`, which each process owns privately
(and which admits against the whole host), or, with `agent_url`, a client of the node's shared
host agent.

Not covered: using one SandboxHost from several processes; a sandbox used by two threads at once
(an episode uses its sandbox from one thread at a time).
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from slipstream.envs.base import InfraError

if TYPE_CHECKING:
    from slipstream.config.sandbox import SandboxConfig
    from slipstream.sandbox import (
        ExecResult,
        Pool,
        PoolOptions,
        PoolStats,
        Sandbox,
        SandboxTemplate,
    )

log = logging.getLogger(__name__)
T = TypeVar("T")
CALL_GRACE_S = 30.0  # on top of a call's own timeouts: margin for a loaded host
# Writable outside the work dir in a bwrap sandbox (the pool's reset wipes only the work dir)
SCRATCH_DIRS = ("/tmp", "/dev/shm")


def _infra_types() -> tuple[type[BaseException], ...]:
    from slipstream.sandbox import SandboxError
    from slipstream.sandbox.pinning import NoCpusFree

    return (SandboxError, OSError, NoCpusFree)


class SandboxHost:
    def __init__(
        self,
        template: SandboxTemplate,
        options: PoolOptions | None = None,
        *,
        state_dir: str | Path | None = None,
        ready_timeout_s: float = 60.0,
        agent_url: str = "",
    ) -> None:
        from slipstream.sandbox import PoolOptions

        self.template = template
        self.options = options or PoolOptions()
        self.state_dir = state_dir
        self.ready_timeout_s = ready_timeout_s
        self.agent_url = agent_url
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._pool: Pool | None = None
        self._closed = False

    @classmethod
    def from_config(cls, cfg: SandboxConfig, agent_url: str = "") -> SandboxHost:
        """A host for the `[sandbox]` section (not started): a private SandboxPool, or, with
        `agent_url` (`rollout.sandbox_agent`, `unix:///path`), a client of the node's host
        agent (sandbox/agent_pool.py), which shares one pool and admission limit per node."""
        from slipstream.sandbox import PoolOptions, SandboxTemplate

        return cls(SandboxTemplate.from_config(cfg), PoolOptions.from_config(cfg),
                   state_dir=cfg.state_dir, ready_timeout_s=cfg.create_timeout_s,
                   agent_url=agent_url)  # fmt: skip

    # ---- lifecycle -----------------------------------------------------------------------------

    def start(self) -> SandboxHost:
        if self._loop is not None or self._closed:
            raise RuntimeError("SandboxHost.start() may be called once")
        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=self._run_loop, args=(loop,), daemon=True,
                                  name="sandbox-host")  # fmt: skip
        thread.start()
        self._loop, self._thread = loop, thread
        atexit.register(self.close)
        try:
            asyncio.run_coroutine_threadsafe(self._start_pool(), loop).result(
                self.ready_timeout_s + CALL_GRACE_S
            )
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
        from slipstream.sandbox import SandboxError, open_pool

        pool = open_pool(self.template, self.options, state_dir=self.state_dir,
                         agent_url=self.agent_url)  # fmt: skip
        self._pool = pool  # before start(): close() must stop a half-started pool too
        await pool.start()
        if reaped := pool.stats().orphans_reaped:
            log.warning("sandbox host: reaped %d orphaned sandboxes", reaped)
        if self.options.min_idle:
            try:
                await pool.wait_ready(self.ready_timeout_s)
            except TimeoutError:
                raise SandboxError(
                    f"sandbox host: no warm {self.template.backend} sandbox within "
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
            log.error("sandbox host: event loop thread did not stop within %s s", timeout_s)

    async def _stop_pool(self) -> None:
        if self._pool is not None:
            await self._pool.stop()
        # calls still in flight (their sandboxes are gone now): cancel them so their callers get
        # an InfraError at once instead of waiting for their timeouts
        me = asyncio.current_task()
        rest = [t for t in asyncio.all_tasks() if t is not me]
        for t in rest:
            t.cancel()
        await asyncio.gather(*rest, return_exceptions=True)

    @property
    def running(self) -> bool:
        return not self._closed and self._loop is not None and self._pool is not None

    # ---- calls ---------------------------------------------------------------------------------

    def call(self, fn: Callable[[], Awaitable[T]], timeout_s: float, what: str) -> T:
        """Run `fn()` on the host's loop and wait at most `timeout_s`; infrastructure failures
        (see the module docstring) raise InfraError naming `what`. Other exceptions pass."""
        with self._lock:  # no submission can race close(): it sets _closed under this lock
            if not self.running:
                raise InfraError(f"{what}: the sandbox host is not running")
            assert self._loop is not None
            fut = asyncio.run_coroutine_threadsafe(fn(), self._loop)  # type: ignore[arg-type]
        try:
            return fut.result(timeout=timeout_s)
        except TimeoutError:
            fut.cancel()
            raise InfraError(f"{what}: no answer within {timeout_s:g} s") from None
        except concurrent.futures.CancelledError:
            raise InfraError(f"{what}: cancelled (the sandbox host stopped)") from None
        except _infra_types() as e:
            raise InfraError(f"{what}: {type(e).__name__}: {e}") from e

    def acquire(self, timeout_s: float | None = None) -> HeldSandbox:
        """One sandbox for the caller (an episode) until `HeldSandbox.release()`."""
        wait_s = self.options.acquire_timeout_s if timeout_s is None else timeout_s
        t0 = time.perf_counter()
        pool = self._pool

        async def take() -> Sandbox:
            return await pool.acquire(wait_s)

        sb = self.call(take, wait_s + CALL_GRACE_S, "sandbox acquire")
        return HeldSandbox(self, sb, time.perf_counter() - t0)

    def capacity(self) -> int | None:
        """How many sandboxes the pool admits at once (its vCPU capacity over the template's
        vCPUs, and max_live), None before start."""
        st = self.stats()
        if st is None:
            return None
        n = int(st.vcpu_capacity // self.template.vcpus)
        return n if self.options.max_live is None else min(n, self.options.max_live)

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


class HeldSandbox:
    """A sandbox acquired from a SandboxHost, used from one thread at a time until release()."""

    def __init__(self, host: SandboxHost, sandbox: Sandbox, acquire_s: float) -> None:
        self.host = host
        self.sandbox = sandbox
        self.acquire_s = acquire_s
        """How long the acquire waited (admission, a warm sandbox, the health check)."""
        self._released = False

    def run(self, fn: Callable[[Sandbox], Awaitable[T]], timeout_s: float, what: str) -> T:
        """`await fn(sandbox)` on the host's loop (InfraError on infrastructure failure)."""
        if self._released:
            raise InfraError(f"{what}: {self.sandbox} was already released")
        sb = self.sandbox

        async def go() -> T:
            return await fn(sb)

        return self.host.call(go, timeout_s, what)

    def exec(
        self,
        argv: Sequence[str],
        *,
        files: Mapping[str, bytes | str] | None = None,
        timeout_s: float,
        cwd: str | None = None,
    ) -> ExecResult:
        """Run a command in the sandbox: its result, however it ended; InfraError only when the
        sandbox itself is gone."""

        async def go(sb: Sandbox) -> ExecResult:
            return await sb.exec(argv, files=files, timeout_s=timeout_s, cwd=cwd)

        # the agent's own hang detection adds 5 s to an exec's timeout; ours comes on top
        return self.run(go, timeout_s + 5.0 + CALL_GRACE_S, "sandbox exec")

    def release(self) -> None:
        """Give the sandbox back: destroyed (single use, the default), or, under `sandbox.reuse`,
        scrubbed and reset for the next episode. The pool's reset kills leftover processes and
        wipes the work dir; the sandbox's other writable places (its private /tmp and /dev/shm)
        are wiped here first, and a sandbox whose scrub fails is destroyed instead of reused.
        Not under the `process` backend, whose /tmp is the host's: it isolates nothing and its
        reuse leaks /tmp between episodes."""
        if self._released:
            return
        clean = True
        # never under `process`: its /tmp is the host's (that backend isolates nothing)
        if self.host.options.reuse and self.host.template.backend != "process":
            try:
                r = self.exec(["find", *SCRATCH_DIRS, "-mindepth", "1", "-delete"], timeout_s=10.0)
                clean = r.exit_code == 0
            except InfraError:
                clean = False
        self._released = True
        pool, sb = self.host._pool, self.sandbox

        async def give_back() -> None:
            if clean:
                await pool.release(sb)
            else:
                await pool.release(sb, reuse=False)

        try:
            self.host.call(give_back, CALL_GRACE_S, "sandbox release")
        except InfraError as e:  # the host stopped (it destroyed the sandbox) or the pool refused
            log.debug("sandbox release: %s", e)
