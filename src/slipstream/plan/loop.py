"""The coordinator's state in the simulator: task queue, experience buffer, admission control.

This is a re-implementation of the semantics of `rl/queue.py` (`TaskQueue`), `rl/buffer.py`
(`ExperienceBuffer`) and `rl/coordinator.py` (`Coordinator.lease`/`ack`/`get_batch`) on plain
integers, with a clock passed in instead of read, so the simulator stays fast and torch-free:

- lease: redelivered tasks first (oldest id first), then fresh ids; at most
  `admission_slots(version, in_flight)` tasks where, at trainer version v,
  slots = (max_staleness + 1 + v) * groups_per_step - (consumed + buffered + in_flight);
- ack: accepted only while the lease is live and still holds the task; the group then enters the
  buffer (at most once per task, because the task leaves the lease);
- nack / expiry: the lease's unacked tasks go back to the front of the queue; a dead lease's
  deadline passing is noticed lazily, at the next call that reaps (as in TaskQueue);
- get_batch: drop groups staler than the bound (counted as wasted, their tasks requeued), then
  take the n oldest (ties by task id) or nothing.

Every call can be recorded (`trace`), and tests/unit/test_plan_queue.py replays the trace on the
real `Coordinator` (TaskQueue + ExperienceBuffer) and checks every result is identical.
Not covered: dynamic sampling (all-equal groups dropped at put), snapshot/restore.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

INFINITE_TTL_S = 1e12  # live instances heartbeat: their leases never expire in the simulation


@dataclass
class _Lease:
    worker_id: str
    task_ids: set[int]
    deadline_s: float


@dataclass
class LoopState:
    """Queue + buffer + version, the simulator's Coordinator. Times are simulated seconds."""

    groups_per_step: int
    max_staleness: int
    group_size: int
    record: bool = False
    version: int = 0
    trace: list[tuple[Any, ...]] = field(default_factory=list)
    # queue
    _pending: deque[int] = field(default_factory=deque)
    _next_task_id: int = 0
    _next_lease_id: int = 1
    _leases: dict[int, _Lease] = field(default_factory=dict)
    _owner: dict[int, int] = field(default_factory=dict)
    _done: set[int] = field(default_factory=set)
    num_redelivered: int = 0
    num_rejected_acks: int = 0
    num_expired_leases: int = 0
    num_nacked: int = 0
    # buffer: (oldest_version, task_id)
    _groups: list[tuple[int, int]] = field(default_factory=list)
    num_consumed: int = 0
    num_put: int = 0
    num_dropped_stale: int = 0
    staleness_hist: Counter[int] = field(default_factory=Counter)
    trained_task_ids: list[int] = field(default_factory=list)
    # in-flight time integral (Little's law)
    _inflight_area: float = 0.0
    _inflight_t: float = 0.0

    def _log(self, *entry: Any) -> None:
        if self.record:
            self.trace.append(entry)

    def _account(self, now: float) -> None:
        self._inflight_area += len(self._owner) * (now - self._inflight_t)
        self._inflight_t = now

    def inflight_area(self, now: float) -> float:
        """Integral over time of the number of leased, unacked tasks, up to `now`."""
        self._account(now)
        return self._inflight_area

    # ---- queue ---------------------------------------------------------------------------------

    def _requeue(self, task_ids: set[int]) -> None:
        for tid in sorted(task_ids, reverse=True):
            self._owner.pop(tid, None)
            self._pending.appendleft(tid)
        self.num_redelivered += len(task_ids)

    def _reap(self, now: float) -> int:
        dead = [lid for lid, st in self._leases.items() if st.deadline_s <= now]
        n = 0
        for lid in dead:
            st = self._leases.pop(lid)
            self.num_expired_leases += 1
            n += len(st.task_ids)
            self._requeue(st.task_ids)
        return n

    def reap(self, now: float) -> int:
        """What any reaping call does (the real queue reaps inside lease, ack, num_in_flight...);
        returns how many tasks came back."""
        self._account(now)
        self._log("reap", now)
        return self._reap(now)

    def num_in_flight(self, now: float) -> int:
        self._reap(now)
        return len(self._owner)

    def admission_slots(self, now: float) -> int:
        """ExperienceBuffer.admission_slots(version, queue.num_in_flight())."""
        in_flight = self.num_in_flight(now)
        cap = (self.max_staleness + 1 + self.version) * self.groups_per_step
        return max(0, cap - (self.num_consumed + len(self._groups) + in_flight))

    def lease(self, worker_id: str, n: int, now: float) -> tuple[int, list[int], int] | None:
        """Coordinator.lease: (lease_id, task ids, policy version) or None."""
        self._account(now)
        slots = self.admission_slots(now)
        result = None
        if slots > 0:
            k = min(n, slots)
            task_ids: list[int] = []
            while len(task_ids) < k and self._pending:
                task_ids.append(self._pending.popleft())
            while len(task_ids) < k:
                task_ids.append(self._next_task_id)
                self._next_task_id += 1
            lease_id = self._next_lease_id
            self._next_lease_id += 1
            self._leases[lease_id] = _Lease(worker_id, set(task_ids), now + INFINITE_TTL_S)
            for tid in task_ids:
                self._owner[tid] = lease_id
            result = (lease_id, task_ids, self.version)
        self._log("lease", now, worker_id, n, None if result is None else (result[0], result[1]))
        return result

    def _live(self, lease_id: int, now: float) -> _Lease | None:
        st = self._leases.get(lease_id)
        if st is None:
            return None
        if st.deadline_s <= now:
            self._reap(now)
            return None
        return st

    def ack(self, lease_id: int, task_id: int, oldest_version: int, now: float) -> bool:
        """Coordinator.ack of the group of `task_id` whose oldest token is `oldest_version`."""
        self._account(now)
        st = self._live(lease_id, now)
        ok = not (st is None or task_id not in st.task_ids or self._owner.get(task_id) != lease_id)
        if ok:
            assert st is not None
            self.num_put += 1
            self._groups.append((oldest_version, task_id))
            st.task_ids.discard(task_id)
            del self._owner[task_id]
            self._done.add(task_id)
            if not st.task_ids:
                del self._leases[lease_id]
        else:
            self.num_rejected_acks += 1
        self._log("ack", now, lease_id, task_id, oldest_version, ok)
        return ok

    def nack(self, lease_id: int, task_ids: list[int] | None, now: float) -> int:
        """Coordinator.nack: how many tasks went back (0 for a dead lease)."""
        self._account(now)
        st = self._live(lease_id, now)
        back: set[int] = set()
        if st is not None:
            back = set(st.task_ids) if task_ids is None else st.task_ids & set(task_ids)
            st.task_ids -= back
            self._requeue(back)
            if not st.task_ids:
                del self._leases[lease_id]
        self.num_nacked += len(back)
        self._log("nack", now, lease_id, None if task_ids is None else list(task_ids), len(back))
        return len(back)

    def extend(self, lease_id: int, ttl_s: float, now: float) -> bool:
        """Coordinator.extend: the last heartbeat of a dying instance sets its lease's deadline."""
        self._account(now)
        st = self._live(lease_id, now)
        if st is not None:
            st.deadline_s = now + ttl_s
        self._log("extend", now, lease_id, ttl_s, st is not None)
        return st is not None

    def lease_deadline(self, lease_id: int) -> float | None:
        st = self._leases.get(lease_id)
        return None if st is None else st.deadline_s

    # ---- buffer / trainer ----------------------------------------------------------------------

    def get_batch(self, n: int, now: float) -> tuple[list[int], list[int], int] | None:
        """Coordinator.get_batch (one try): (task ids sorted, staleness per group, number of
        stale groups dropped) or None. Dropped groups' tasks are requeued either way."""
        self._account(now)
        v = self.version
        keep, stale = [], []
        for g in self._groups:
            (stale if v - g[0] > self.max_staleness else keep).append(g)
        self._groups = keep
        self.num_dropped_stale += len(stale)
        result = None
        if len(self._groups) >= n:
            self._groups.sort()
            taken, self._groups = self._groups[:n], self._groups[n:]
            taken.sort(key=lambda g: g[1])
            staleness = [v - min(g[0], v) for g in taken]
            for s in staleness:
                self.staleness_hist[s] += 1
            self.num_consumed += n
            self.trained_task_ids.extend(g[1] for g in taken)
            result = ([g[1] for g in taken], staleness, len(stale))
        if stale:  # on_stale -> queue.requeue (only tasks still done go back)
            back = {g[1] for g in stale if g[1] in self._done}
            self._done -= back
            self._requeue(back)
        self._log("get_batch", now, n, None if result is None else result[0],
                  sorted(g[1] for g in stale))  # fmt: skip
        return result

    def set_version(self, version: int, now: float) -> None:
        self.version = version
        self._log("set_version", now, version)

    @property
    def num_buffered(self) -> int:
        return len(self._groups)

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def num_leased(self) -> int:
        return len(self._owner)

    def done_ids(self) -> set[int]:
        return set(self._done)
