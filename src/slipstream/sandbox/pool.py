"""The host agent's warm pool: one `SandboxPool` per template.

Contract:
- `start()` reaps orphans recorded in the journal by a crashed earlier owner, then keeps at least
  `min_idle` warm sandboxes (never more than `max_idle`) with a background refill task that creates
  at most `create_concurrency` at once, each start delayed by a random jitter (no thundering herd).
- `acquire(timeout_s)` hands out an idle sandbox after a health check (ping; a failing one is
  destroyed and the next tried), or creates one inline when none is idle and admission allows, or
  waits. Admission: the vCPUs of all live sandboxes (idle, in use, being created or destroyed)
  stay <= online vCPUs x `max_density`, a new sandbox's memory limit fits in MemAvailable minus
  `memory_reserve_mib`, and the pinning policy has CPUs free. Waiting longer than the timeout raises
  AdmissionTimeout. Waiters queue in arrival order: a sandbox that becomes idle (refilled, or
  returned with reuse) is handed to the longest waiter directly, and a change that may admit a
  create (a create or destroy finishing) wakes one waiter, not all of them — with dozens of
  verify threads per pool a wake-everyone condition spends the CPU the sandboxes need.
- `release(sb)`: single use by default — the sandbox is destroyed (in the background) and replaced by
  the refill; with `reuse=True` it is `reset()` and returned to the idle set.
- `stop()` destroys every sandbox (idle and handed-out) and leaves no process, cgroup or dir; the
  journal is empty afterwards.

Not covered: several pools sharing admission (each pool admits against the whole host on its own),
priority between waiters (a new caller may still take an idle sandbox or start a create before
a woken waiter runs), admission changes nothing announces (MemAvailable rising: waiters re-check
on their deadline), sandboxes shared between event loops.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import itertools
import logging
import os
import random
import secrets
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, Self

from slipstream.sandbox.base import (
    AgentSandbox,
    Backend,
    Sandbox,
    SandboxTemplate,
    make_backend,
    reaper_for,
)
from slipstream.sandbox.errors import AdmissionTimeout, SandboxError
from slipstream.sandbox.host_topology import Topology, read_topology
from slipstream.sandbox.journal import Journal, default_state_dir
from slipstream.sandbox.pinning import NoCpusFree, PinningAllocator

if TYPE_CHECKING:
    from slipstream.config.sandbox import SandboxConfig

log = logging.getLogger(__name__)
_ids = itertools.count()


def mem_available_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise OSError("no MemAvailable in /proc/meminfo")


def percentile(samples: list[float], q: float) -> float | None:
    """The `q` quantile of `samples` (nearest rank), None when there are none."""
    if not samples:
        return None
    s = sorted(samples)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


@dataclass
class PoolOptions:
    min_idle: int = 2
    max_idle: int = 4
    max_density: float = 1.0
    create_concurrency: int = 2
    jitter_s: float = 0.005
    reuse: bool = False
    health_check: bool = True
    acquire_timeout_s: float = 60.0
    memory_reserve_mib: int = 256
    max_live: int | None = None
    """Extra cap on live sandboxes (None = only the vCPU/memory rules)."""

    @classmethod
    def from_config(cls, cfg: SandboxConfig) -> PoolOptions:
        """The pool options of a `[sandbox]` config section."""
        return cls(**{k: getattr(cfg, k) for k in cls.__dataclass_fields__ if hasattr(cfg, k)})


@dataclass
class PoolStats:
    live: int
    idle: int
    in_use: int
    creating: int
    created: int
    destroyed: int
    create_failures: int
    health_failures: int
    acquires: int
    acquire_wait_p50_s: float | None
    acquire_wait_p99_s: float | None
    vcpu_capacity: float
    pinning: str
    notes: list[str] = field(default_factory=list)
    orphans_reaped: int = 0
    """Sandboxes of dead owners this pool reaped from its journal at start (a host agent's
    client reaps none: the agent does)."""


class Pool(Protocol):
    """A pool that hands out sandboxes: what every caller uses of the in-process `SandboxPool`
    and of `AgentPool`, the client of the node's host agent. Built by one factory,
    `agent_pool.open_pool` (`make_pool` for a `[sandbox]` config section). Not started when
    built: `await pool.start()` or `async with pool:`."""

    template: SandboxTemplate

    @abc.abstractmethod
    async def start(self) -> Self:
        """Ready to hand out sandboxes (the in-process pool reaps journal orphans first)."""

    @abc.abstractmethod
    async def wait_ready(self, timeout_s: float = 60.0) -> None:
        """Until min_idle sandboxes are warm (TimeoutError otherwise)."""

    @abc.abstractmethod
    async def acquire(self, timeout_s: float | None = None) -> Sandbox:
        """A sandbox for the caller until `release`; SandboxError subclasses when none comes."""

    @abc.abstractmethod
    async def release(self, sb: Sandbox, *, reuse: bool | None = None) -> None:
        """Give `sb` back: destroyed, or reset and reused (`reuse`, default the pool's option)."""

    @abc.abstractmethod
    def stats(self) -> PoolStats: ...

    @abc.abstractmethod
    async def stop(self) -> None:
        """Destroy (release) every sandbox still held; nothing is left behind. Idempotent."""

    async def __aenter__(self) -> Self:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    @contextlib.asynccontextmanager
    async def sandbox(self, timeout_s: float | None = None) -> AsyncIterator[Sandbox]:
        """`async with pool.sandbox() as sb:` acquire + release."""
        sb = await self.acquire(timeout_s)
        try:
            yield sb
        finally:
            await self.release(sb)


class SandboxPool(Pool):
    def __init__(
        self,
        template: SandboxTemplate,
        options: PoolOptions | None = None,
        *,
        backend: Backend | None = None,
        state_dir: str | Path | None = None,
        topology: Topology | None = None,
    ) -> None:
        self.template = template
        self.opts = options or PoolOptions()
        if self.opts.max_idle < self.opts.min_idle:
            raise ValueError(f"max_idle={self.opts.max_idle} < min_idle={self.opts.min_idle}")
        self.state_dir = Path(state_dir) if state_dir else default_state_dir()
        self.journal = Journal(self.state_dir)
        self.backend = backend or make_backend(
            template.backend, state_dir=self.state_dir, journal=self.journal
        )
        if self.backend.journal not in (None, self.journal):  # None: the pool records them
            log.warning(
                "pool backend writes another journal; orphan reaping uses %s", self.state_dir
            )
        self.topology = topology or read_topology()
        self.pinning = PinningAllocator(self.topology, template.pinning, template.memory_policy)
        self.vcpu_capacity = len(self.pinning.cpus) * self.opts.max_density
        self._idle: deque[AgentSandbox] = deque()
        self._in_use: set[AgentSandbox] = set()
        self._creating = 0
        self._destroying = 0
        self._live_vcpus = 0
        # The refill loop and wait_ready() wait on this condition; acquirers do not (see _waiters).
        self._changed = asyncio.Condition()
        # Acquirers waiting, oldest first. A future's result is the sandbox handed to it (already
        # in _in_use) or None: "something changed, look again".
        self._waiters: deque[asyncio.Future[AgentSandbox | None]] = deque()
        self._refill_task: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._create_sem = asyncio.Semaphore(self.opts.create_concurrency)
        self._waits_s: deque[float] = deque(maxlen=100_000)
        self._counts = {"created": 0, "destroyed": 0, "create_failures": 0, "health_failures": 0}
        self._acquires = 0
        self._stopping = False
        self._orphans_reaped = 0

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> Self:
        self._orphans_reaped = await asyncio.to_thread(self.journal.reap_orphans, reaper_for)
        self._refill_task = asyncio.get_running_loop().create_task(self._refill_loop())
        return self

    async def wait_ready(self, timeout_s: float = 60.0) -> None:
        """Wait until min_idle sandboxes are warm (or admission forbids more)."""
        async with self._changed:
            await asyncio.wait_for(
                self._changed.wait_for(
                    lambda: (
                        len(self._idle) >= self.opts.min_idle
                        or (
                            self._creating == 0 and self._destroying == 0 and not self._admissible()
                        )
                    )
                ),
                timeout_s,
            )

    async def stop(self) -> None:
        self._stopping = True
        while self._waiters:  # every waiter looks again and raises "pool is stopping"
            self._wake_one()
        if self._refill_task:
            self._refill_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._refill_task
        while self._creating or self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
            await asyncio.sleep(0.001)
        victims = list(self._idle) + list(self._in_use)
        if self._in_use:
            log.warning("pool stop: destroying %d sandboxes still in use", len(self._in_use))
        self._idle.clear()
        self._in_use.clear()
        await asyncio.gather(*(self._destroy(sb) for sb in victims))
        await self.backend.close()

    # ------------------------------------------------------------ admission

    def _live(self) -> int:
        return len(self._idle) + len(self._in_use) + self._creating + self._destroying

    def _admissible(self) -> bool:
        v = self.template.vcpus
        if self._live_vcpus + v > self.vcpu_capacity + 1e-9:
            return False
        if self.opts.max_live is not None and self._live() >= self.opts.max_live:
            return False
        if not self.pinning.can_allocate(v):
            return False
        need = (self.template.memory_mib + self.opts.memory_reserve_mib) << 20
        return mem_available_bytes() >= need

    @property
    def stopping(self) -> bool:
        """stop() was called: acquires fail from now on."""
        return self._stopping

    def full(self) -> bool:
        """True when no sandbox can be handed out before something is released: none idle, none
        being created or destroyed, and admission refuses another (the host agent then answers
        "no capacity" at once instead of queueing the request)."""
        return (
            not self._idle and not self._creating and not self._destroying
            and not self._admissible()
        )  # fmt: skip

    def admission_state(self) -> str:
        """One line naming what admission counts, for "no capacity" messages."""
        return (
            f"live={self._live()} in_use={len(self._in_use)} "
            f"vcpus={self._live_vcpus}/{self.vcpu_capacity:g} (max_density "
            f"{self.opts.max_density:g}) max_live={self.opts.max_live} "
            f"free_cpus={len(self.pinning.free)} pinning={self.template.pinning} "
            f"mem_available={mem_available_bytes() >> 20} MiB"
        )

    async def _create_one(self) -> AgentSandbox:
        """Create a sandbox (admission already reserved by the caller: _creating and vcpus)."""
        cpus = None
        ok = False
        try:
            cpus = self.pinning.allocate(self.template.vcpus)
            sid = f"sb-{os.getpid()}-{next(_ids)}-{secrets.token_hex(3)}"
            async with self._create_sem:
                sb = await self.backend.create(
                    self.template, sandbox_id=sid, cpus=cpus, mems=self.pinning.mems_for(cpus)
                )
            ok = True
        finally:
            self._creating -= 1
            if not ok:  # any failure, cancellation included, gives the reservation back
                self.pinning.release(cpus)
                self._live_vcpus -= self.template.vcpus
                self._counts["create_failures"] += 1
            self._wake_one()  # acquire creates inline only while nothing else is being created
        self._counts["created"] += 1
        if sb.journal is None:  # backends without journal support: the pool records them
            sb.journal = self.journal
            self.journal.write(sb.record())
        return sb

    def _reserve(self) -> None:
        self._creating += 1
        self._live_vcpus += self.template.vcpus

    # ------------------------------------------------------------ refill

    async def _refill_loop(self) -> None:
        while not self._stopping:
            async with self._changed:
                await self._changed.wait_for(self._wants_more)
                self._reserve()
                self._spawn(self._refill_one())

    def _wants_more(self) -> bool:
        # With reuse, handed-out sandboxes come back: replacing them too would churn.
        returning = len(self._in_use) if self.opts.reuse else 0
        return (
            len(self._idle) + self._creating + returning < self.opts.min_idle
            and len(self._idle) < self.opts.max_idle
            and self._admissible()
        )

    async def _refill_one(self) -> None:
        try:
            await asyncio.sleep(random.uniform(0, self.opts.jitter_s))
            sb = await self._create_one()
        except (SandboxError, OSError, NoCpusFree) as e:
            log.warning("pool refill: sandbox creation failed: %s", e)
            await asyncio.sleep(0.5)  # do not spin on a persistent failure
            await self._notify()
            return
        if self._stopping:
            await self._destroy(sb)
            return
        self._put_idle(sb)
        await self._notify()

    def _spawn(self, coro: object) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(coro)  # type: ignore[arg-type]
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    def _next_waiter(self) -> asyncio.Future[AgentSandbox | None] | None:
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():  # done: it timed out, was cancelled or was already woken
                return fut
        return None

    def _wake_one(self) -> None:
        """Tell the longest waiter to look again (admission may allow a create now)."""
        fut = self._next_waiter()
        if fut is not None:
            fut.set_result(None)

    def _put_idle(self, sb: AgentSandbox) -> None:
        """A ready sandbox: to the longest waiter if there is one, else into the idle set."""
        fut = self._next_waiter()
        if fut is None:
            self._idle.append(sb)
            return
        self._in_use.add(sb)
        fut.set_result(sb)

    # ------------------------------------------------------------ hand-out

    async def acquire(self, timeout_s: float | None = None) -> AgentSandbox:
        timeout_s = self.opts.acquire_timeout_s if timeout_s is None else timeout_s
        t0 = time.perf_counter()
        deadline = time.monotonic() + timeout_s
        woken = False
        while True:
            if self._stopping:
                raise SandboxError("pool is stopping")
            # No await between looking at the state and changing it: the event loop runs one
            # coroutine at a time, so no lock is needed here.
            sb = None
            create = False
            if self._idle:
                sb = self._idle.popleft()
                self._in_use.add(sb)
            elif self._creating == 0 and self._admissible():
                self._reserve()
                create = True
            else:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise AdmissionTimeout(
                        f"no sandbox within {timeout_s} s: live={self._live()} "
                        f"vcpus={self._live_vcpus}/{self.vcpu_capacity:g} "
                        f"free_cpus={len(self.pinning.free)} pinning={self.template.pinning}"
                    )
                # A waiter woken before keeps its place at the front; a new one queues last.
                sb = await self._wait_turn(remaining, front=woken)
                woken = True
                if sb is None:
                    continue
            if create:
                sb = await self._create_one()
                self._in_use.add(sb)
            assert sb is not None
            try:
                if self.opts.health_check and not create:
                    try:
                        await sb.ping()
                    except SandboxError as e:
                        if sb not in self._in_use:  # stop() destroyed it meanwhile; loop raises
                            continue
                        self._counts["health_failures"] += 1
                        log.warning("pool: %s failed its health check (%s); replacing it", sb, e)
                        self._in_use.discard(sb)
                        self._spawn(self._destroy(sb))
                        continue
                self._acquires += 1
                self._waits_s.append(time.perf_counter() - t0)
                await self._notify()  # the refill loop may now want a replacement
            except asyncio.CancelledError:
                # Cancelled after the sandbox became ours but before the caller got it: nobody
                # would ever release it, so it goes back to the pool here.
                if sb in self._in_use:
                    self._spawn(self._give_back(sb, self.opts.reuse))
                raise
            return sb

    async def _wait_turn(self, timeout_s: float, *, front: bool) -> AgentSandbox | None:
        """Queue as a waiter until handed a sandbox (returned, in _in_use) or woken (None); the
        deadline wakes it too. A caller cancelled at the moment a sandbox was handed to it gives
        the sandbox to the next waiter, and an unused wake is passed on, so neither is lost."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[AgentSandbox | None] = loop.create_future()
        (self._waiters.appendleft if front else self._waiters.append)(fut)

        def deadline_passed() -> None:
            if not fut.done():  # still queued: leave the queue, then look once more
                self._waiters.remove(fut)
                fut.set_result(None)

        timer = loop.call_later(timeout_s, deadline_passed)
        try:
            return await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                got = fut.result()
                if got is None:
                    self._wake_one()
                elif got in self._in_use:  # not when stop() has taken (and destroyed) it
                    self._in_use.discard(got)
                    self._put_idle(got)
            raise
        finally:
            timer.cancel()
            if not fut.done():  # cancelled while queued (a handed or woken one was popped)
                fut.cancel()
                self._waiters.remove(fut)

    async def release(self, sb: Sandbox, *, reuse: bool | None = None) -> None:
        if not isinstance(sb, AgentSandbox) or sb not in self._in_use:
            raise SandboxError(f"{sb} was not acquired from this pool")
        reuse = self.opts.reuse if reuse is None else reuse
        # The reset runs as a pool task the caller only waits on: a caller cancelled while the
        # sandbox resets (a rollout torn down mid-release) must not strand it in _in_use.
        await asyncio.shield(self._spawn(self._give_back(sb, reuse)))

    async def _give_back(self, sb: AgentSandbox, reuse: bool) -> None:
        """Reset a returned sandbox for the next caller (or destroy it); runs as a pool task."""
        if reuse and not self._stopping and not sb.conn.closed:
            try:
                await sb.reset()
            except SandboxError as e:
                log.warning("pool: reset of %s failed (%s); destroying it", sb, e)
            else:
                self._in_use.discard(sb)
                if self._waiters or len(self._idle) < self.opts.max_idle:
                    self._put_idle(sb)
                    await self._notify()
                    return
                self._in_use.add(sb)
        self._in_use.discard(sb)
        self._destroying += 1
        self._spawn(self._destroy(sb, counted=True))

    async def _destroy(self, sb: AgentSandbox, counted: bool = False) -> None:
        if not counted:
            self._destroying += 1
        try:
            await sb.release()
        except (SandboxError, OSError) as e:
            log.error("pool: destroying %s failed: %s (left to orphan reaping)", sb, e)
        finally:
            self._destroying -= 1
            self._live_vcpus -= self.template.vcpus
            self.pinning.release(sb.cpus)
            self._counts["destroyed"] += 1
            self._wake_one()  # its vCPUs and CPUs are free: one waiter may create now
            await self._notify()

    # ------------------------------------------------------------ stats

    def stats(self) -> PoolStats:
        waits = list(self._waits_s)
        return PoolStats(
            live=self._live(),
            idle=len(self._idle),
            in_use=len(self._in_use),
            creating=self._creating,
            created=self._counts["created"],
            destroyed=self._counts["destroyed"],
            create_failures=self._counts["create_failures"],
            health_failures=self._counts["health_failures"],
            acquires=self._acquires,
            acquire_wait_p50_s=percentile(waits, 0.5),
            acquire_wait_p99_s=percentile(waits, 0.99),
            vcpu_capacity=self.vcpu_capacity,
            pinning=self.template.pinning,
            notes=list(self.pinning.notes),
            orphans_reaped=self._orphans_reaped,
        )
