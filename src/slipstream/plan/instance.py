"""State of one simulated rollout instance (a RolloutWorker with its engine) and the worker
loop's timing rules.

The worker loop (rl/worker.py `_run_loop`) per iteration: ask the coordinator whether it is
stopping (one RPC), and if it has room, lease (one more RPC); when nothing was leased it waits
`idle_s` on its condition variable (woken early when one of its own tasks finishes), and idle_s
doubles after every wait, from 5 ms up to 50 ms; a successful lease resets it. `backoff_chain`
reproduces when a worker that keeps failing next asks, without simulating every failed poll.

Not covered: RPC latency that depends on load (one constant per call), GIL contention between
the worker's threads beyond what the engine slowdown factor absorbs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np


@dataclass(eq=False)
class Work:
    """One leased task on an instance: a generate request of G samples, then G verifications."""

    task_id: int
    lease_id: int
    lengths: np.ndarray  # [G] completion tokens per sample
    submitted_s: float
    oldest_version: int = -1
    generated_s: float = -1.0
    done: bool = False  # acked, nacked or abandoned
    admitted: bool = False
    ix: int = 0  # the instance's index of this work (row -> work mapping)
    tau_start: int = 0  # the instance's token clock when the group was admitted


@dataclass(eq=False)
class Instance:
    """A rollout instance. `gen` counts incarnations: events carry it and are ignored once the
    instance was replaced (a Spot reclaim)."""

    idx: int
    spot: bool
    gen: int = 0
    alive: bool = False
    draining: bool = False
    # worker loop
    inflight: dict[int, Work] = field(default_factory=dict)
    leases: dict[int, set[int]] = field(default_factory=dict)
    idle_s: float = 0.005
    wait_start_s: float = 0.0
    wait_len_s: float = 0.0
    # "" (busy), "room" (no room), "admission" (lease returned nothing), "version_rpc" / "sync"
    # (bringing the engine to the coordinator's version before starting a lease)
    waiting: str = ""
    loop_token: int = 0
    sync_min_version: int = -1
    sync_lease: tuple[int, list[int]] | None = None  # (lease id, task ids) to start after sync
    # engine
    version: int = 0
    queue: list[Work] = field(default_factory=list)  # submitted, not admitted (FIFO)
    # Token clock: tokens every running row has produced since the instance started. A row
    # admitted at clock t0 with length L finishes when the clock reaches t0 + L.
    tau: int = 0
    active_rows: int = 0
    row_heap: list[tuple[int, int]] = field(default_factory=list)  # (finish clock, work ix)
    work_heap: list[tuple[int, int]] = field(default_factory=list)  # (last row's finish, ix)
    stepping: bool = False
    pending_apply: int | None = None
    # weights
    loading: bool = False  # the worker's weights lock is held (fetch + apply in progress)
    load_by: str = ""  # "loop" (sync before a lease), "watcher" or "push" (weights.sync)
    watcher_origin_s: float = 0.0
    watcher_scheduled_s: float = math.inf
    watcher_blocked: bool = False
    works: dict[int, Work] = field(default_factory=dict)  # Work.ix -> admitted work
    next_work_ix: int = 0
    # spot
    up_since_s: float = 0.0
    up_time_s: float = 0.0

    @property
    def worker_id(self) -> str:
        return f"w{self.idx}.{self.gen}"

    @property
    def num_rows(self) -> int:
        return self.active_rows

    def num_inflight(self) -> int:
        """Tasks held (generating or verifying): done ones leave `inflight` at once."""
        return len(self.inflight)

    def num_generating(self) -> int:
        """Tasks held whose generation has not finished (not yet verifying)."""
        return sum(1 for w in self.inflight.values() if w.generated_s < 0)


def backoff_chain(
    wait_start_s: float, wait_len_s: float, t: float, rpc_s: float, cap_s: float
) -> tuple[float, float]:
    """A worker began a wait of wait_len_s at wait_start_s and keeps finding nothing to do: each
    wait is followed by an iteration costing rpc_s, then a wait twice as long (capped at cap_s).
    Returns (time of the first iteration end at or after t, idle_s after it) — that is, when the
    worker would next act on a change that happened at t, and its backoff state then."""
    end = wait_start_s + wait_len_s + rpc_s  # first iteration after the first wait
    w = wait_len_s
    while end < t and w < cap_s:
        w = min(2 * w, cap_s)
        end += w + rpc_s
    if end < t:
        n = math.ceil((t - end) / (cap_s + rpc_s))
        end += n * (cap_s + rpc_s)
        w = cap_s
    return end, min(2 * w, cap_s)


def wake_on_notify(
    wait_start_s: float, wait_len_s: float, t: float, rpc_s: float, cap_s: float
) -> tuple[float, float]:
    """A worker in the same chain is notified at t (one of its tasks finished): if it is inside
    a wait it wakes at t; if it is inside an iteration it sees the change when that ends.
    Returns (wake time, idle_s after the wake)."""
    start, w = wait_start_s, wait_len_s
    if t < start:  # before the wait began (the worker is still in its round trip): a condition
        return start + w, min(2 * w, cap_s)  # variable drops it, so the wait runs in full
    while True:
        if t < start + w:  # inside this wait: the notify ends it
            return t, min(2 * w, cap_s)
        if t < start + w + rpc_s:  # inside the iteration after it
            return start + w + rpc_s, min(2 * w, cap_s)
        start, w = start + w + rpc_s, min(2 * w, cap_s)
        if w >= cap_s and t >= start + cap_s + rpc_s:  # jump over whole capped cycles
            n = math.floor((t - start) / (cap_s + rpc_s))
            start += n * (cap_s + rpc_s)
