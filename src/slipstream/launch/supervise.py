"""Supervision of rollout worker slots, one policy for every launcher: when to replace a worker
that ended, and when to give up.

`Supervisor` is the loop both launchers run (a thread polling every 0.2 s); a launcher supplies
how to start a slot's worker (`spawn`) and how to tell that it ended (`ended`), and the policy
below decides the rest:

A worker that ended after it reached the coordinator (it leased or reported at least once) was
lost the way a Spot node is lost: it is replaced at once and the slot's failure count is reset.
A worker that ended before it ever reached the coordinator failed to start (a bad engine
option, a missing dependency on the node, a broken image); restarting it again and again only
burns CPU and fills the log directory. Such start failures are retried with exponential
backoff (`rollout.restart_backoff_s`, doubling, at most `rollout.restart_backoff_max_s`), and
after `rollout.max_start_failures` in a row the slot is declared crash-looping: the launcher
fails the job through `Coordinator.fail`, with the worker's last output in the message, instead
of the trainer waiting out `trainer.batch_timeout_s`.

A worker that found its node draining (Ray: `rollout.drain_file`) is neither a loss nor a start
failure: its slot is tried again after `restart_backoff_s` (counted in `num_drain_retries`).

Not covered: a worker that starts, leases once, and then crashes on every task (each incarnation
counts as a loss, not a start failure); the trainer's batch timeout still bounds that case.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slipstream.config.rl import RolloutConfig

log = logging.getLogger(__name__)


@dataclass
class RestartPolicy:
    """Per worker slot: schedule() when its worker ended, due() for the slots to start now."""

    max_start_failures: int
    backoff_s: float
    backoff_max_s: float
    start_failures: dict[int, int] = field(default_factory=dict)
    """Slot index -> start failures in a row."""
    restart_at: dict[int, float] = field(default_factory=dict)
    """Slot index -> monotonic time its replacement starts (slots waiting out a backoff)."""

    @classmethod
    def from_config(cls, rc: RolloutConfig) -> RestartPolicy:
        return cls(rc.max_start_failures, rc.restart_backoff_s, rc.restart_backoff_max_s)

    def delay_s(self, index: int, reached_coordinator: bool) -> float | None:
        """Record that slot `index`'s worker ended; -> seconds to wait before starting its
        replacement, or None when the slot has failed to start max_start_failures times in a row."""
        if reached_coordinator:
            self.start_failures[index] = 0
            return 0.0
        n = self.start_failures.get(index, 0) + 1
        self.start_failures[index] = n
        if n >= self.max_start_failures:
            return None
        return min(self.backoff_s * 2 ** (n - 1), self.backoff_max_s)

    def schedule(self, index: int, reached_coordinator: bool, now_s: float) -> float | None:
        """delay_s(), and remember when the replacement is due; None: crash loop, give up."""
        delay_s = self.delay_s(index, reached_coordinator)
        if delay_s is not None:
            self.restart_at[index] = now_s + delay_s
        return delay_s

    def schedule_draining(self, index: int, now_s: float) -> float:
        """The slot's actor found its node draining and did not start: try again after
        backoff_s (by then the node may be gone and the actor placed elsewhere). Not a start
        failure: a reclaimed node is not a broken image."""
        self.restart_at[index] = now_s + self.backoff_s
        return self.backoff_s

    def waiting(self, index: int) -> bool:
        """Whether the slot's replacement is scheduled and not started yet."""
        return index in self.restart_at

    def due(self, now_s: float) -> list[int]:
        """The slots whose replacement should start now (each is returned once)."""
        ready = [i for i, t in self.restart_at.items() if now_s >= t]
        for i in ready:
            del self.restart_at[i]
        return ready


def fail_job(coord: Any, index: int, worker_id: str, code: int | None, n: int, output: str) -> None:
    """Give up on slot `index`: log it and fail the coordinator with the reason (the trainer's
    wait raises RolloutFailed carrying it)."""
    log.error("rollout worker slot %d crash-loops (%s); failing the job", index, worker_id)
    coord.fail(crash_loop_message(index, worker_id, code, n, output))


def crash_loop_message(index: int, worker_id: str, code: int | None, n: int, output: str) -> str:
    """The job's failure reason for a crash-looping slot, ending with the worker's last output."""
    lines = output.strip().splitlines()[-20:]
    tail = "\n".join(f"  | {line}" for line in lines) if lines else "  | (no output)"
    return (
        f"rollout worker slot {index} failed to start {n} times in a row (last: {worker_id}, "
        f"exit {code}) before it ever reached the coordinator; not restarting it. "
        f"Its last output:\n{tail}"
    )


def log_tail(path: Path, max_bytes: int = 8192) -> str:
    """The end of a worker's log file ('' when it is missing)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - max_bytes))
            return f.read().decode(errors="replace")
    except FileNotFoundError:
        return ""


@dataclass(frozen=True)
class Ended:
    """How a slot's worker ended: its exit code (None: killed, or its actor died), its last
    output (for the crash-loop message), and whether it refused to start on a draining node."""

    code: int | None
    output: str = ""
    draining: bool = False


class Supervisor:
    """Replaces ended workers per `RestartPolicy` until the job stops, from a daemon thread.

    The launcher provides `spawn(index)` (start a new worker for the slot under
    `worker_id(index)`, called with `lock` held) and `ended(index)` (an `Ended` once the slot's
    current worker has ended, else None; called with `lock` held). `before_poll()` runs first
    in every round (the Ray launcher records actors that reported in). The launcher's own
    methods that touch its slots take `lock` too.

    `restart=False` (tests): ended workers are left ended."""

    poll_s = 0.2

    def __init__(self, coord: Any, policy: RestartPolicy, slots: Iterable[int], *,
                 spawn: Callable[[int], None], ended: Callable[[int], Ended | None],
                 restart: bool = True, before_poll: Callable[[], None] | None = None,
                 name: str = "supervisor") -> None:  # fmt: skip
        self.coord = coord
        self.policy = policy
        self.slots = list(slots)
        self.spawn, self.ended, self.before_poll = spawn, ended, before_poll
        self.restart = restart
        self.name = name
        self.lock = threading.Lock()
        self.generation: dict[int, int] = {}
        self.num_restarts = 0
        self.num_drain_retries = 0
        self._drain_retry: set[int] = set()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def next_worker_id(self, index: int) -> str:
        """A new generation for the slot; its worker id, "w<index>.<generation>"."""
        self.generation[index] = self.generation.get(index, -1) + 1
        return self.worker_id(index)

    def worker_id(self, index: int) -> str:
        """The id of the slot's current worker."""
        return f"w{index}.{self.generation[index]}"

    def start(self) -> None:
        """Spawn every slot's first worker, then supervise from a daemon thread."""
        with self.lock:
            for i in self.slots:
                self.spawn(i)
        self._thread = threading.Thread(target=self._run, daemon=True, name=self.name)
        self._thread.start()

    def stop(self) -> None:
        """No more replacements; returns when the supervision thread has ended."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        while not self._stopping.wait(self.poll_s):
            with self.lock:
                if self.before_poll is not None:
                    self.before_poll()
                if self._stopping.is_set() or self.coord.stopping() or not self.restart:
                    continue
                if not self._poll(time.monotonic()):
                    return

    def _poll(self, now_s: float) -> bool:
        """One round: schedule replacements of ended workers, start the due ones. False when a
        slot crash-loops (the job has been failed)."""
        for i in self.slots:
            if self.policy.waiting(i):
                continue
            ended = self.ended(i)
            if ended is None:
                continue
            wid = self.worker_id(i)
            if ended.draining:
                self.policy.schedule_draining(i, now_s)
                self._drain_retry.add(i)
                continue
            delay_s = self.policy.schedule(i, self.coord.reached(wid), now_s)
            if delay_s is None:
                fail_job(self.coord, i, wid, ended.code, self.policy.max_start_failures,
                         ended.output)  # fmt: skip
                return False
            log.warning("rollout worker %d (%s) ended with %s; replacing it in %.1f s",
                        i, wid, ended.code, delay_s)  # fmt: skip
        for i in self.policy.due(now_s):
            if i in self._drain_retry:
                self._drain_retry.discard(i)
                self.num_drain_retries += 1
            else:
                self.num_restarts += 1
            self.spawn(i)
        return True
