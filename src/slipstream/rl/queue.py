"""TaskQueue: tasks handed to rollout workers under leases (visibility timeouts) with fencing.

Contract:
- `lease(worker_id, n, ttl_s)` hands out up to n tasks; redelivered tasks come first (oldest task
  id first), then fresh ones.
- `ack(lease_id, group)` accepts a group only while the lease is live (not expired, not nacked,
  not superseded) and still holds that task; an accepted group is passed to the `sink` (the
  experience buffer) under the queue's lock, so a task's group reaches the sink at most once.
- `nack(lease_id)` returns the lease's unacked tasks to the front of the queue.
- `extend(lease_id, ttl_s)` pushes a live lease's deadline out; it fails on a dead lease.
- A lease past its deadline is dead: its tasks are redelivered to the next `lease` call, and a
  later ack from it is rejected (the lease id is the fencing token; ids are never reused, also
  across snapshot/restore).
- `requeue(task_ids)` turns done tasks back into pending ones (a group dropped as too stale).
- `drop(lease_id, task_ids)` gives up on leased tasks without a group (their episodes kept
  failing for infrastructure reasons): they count as done, never reach the sink, and are not
  redelivered (`num_dropped`).
- `snapshot()`/`restore()` carry pending + done + counters; leases are not carried: their tasks
  come back as pending (the worker that held them can no longer ack).

Not covered: persistence by itself (the checkpoint writes the snapshot), priorities, more than one
process touching the same instance (the local launcher serves it from the trainer process).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from slipstream.rl.types import Group, Lease, TaskRef


@dataclass
class _LeaseState:
    worker_id: str
    task_ids: set[int]
    deadline_s: float


@dataclass
class QueueStats:
    num_pending: int
    num_leased: int
    num_done: int
    num_redelivered: int
    num_rejected_acks: int
    num_expired_leases: int
    num_dropped: int = 0


class TaskQueue:
    """In-memory, thread-safe task queue. `num_prompts` is the size of the train split (task_id
    maps to prompt index task_id % num_prompts); `max_tasks` bounds the total number of tasks
    (None = an endless stream of epochs)."""

    def __init__(
        self,
        num_prompts: int,
        *,
        max_tasks: int | None = None,
        sink: Callable[[Group], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if num_prompts < 1:
            raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
        self.num_prompts = num_prompts
        self.max_tasks = max_tasks
        self._sink = sink
        self._clock = clock
        self._lock = threading.RLock()
        self._pending: deque[int] = deque()
        self._next_task_id = 0
        self._next_lease_id = 1
        self._leases: dict[int, _LeaseState] = {}
        self._owner: dict[int, int] = {}  # task_id -> lease_id currently holding it
        self._done: set[int] = set()
        self._num_redelivered = 0
        self._num_rejected_acks = 0
        self._num_expired_leases = 0
        self._num_dropped = 0

    @property
    def lock(self) -> threading.RLock:
        """Held while the sink runs: hold it to snapshot the queue and the sink's state together."""
        return self._lock

    def set_sink(self, sink: Callable[[Group], None]) -> None:
        self._sink = sink

    def _ref(self, task_id: int) -> TaskRef:
        return TaskRef(task_id=task_id, index=task_id % self.num_prompts)

    def _requeue(self, task_ids: set[int]) -> None:
        # Redelivered tasks go first, oldest first, so a run's task order stays close to FIFO.
        for tid in sorted(task_ids, reverse=True):
            self._owner.pop(tid, None)
            self._pending.appendleft(tid)
        self._num_redelivered += len(task_ids)

    def _reap(self) -> None:
        now = self._clock()
        dead = [lid for lid, st in self._leases.items() if st.deadline_s <= now]
        for lid in dead:
            st = self._leases.pop(lid)
            self._num_expired_leases += 1
            self._requeue(st.task_ids)

    def lease(self, worker_id: str, n: int, ttl_s: float, policy_version: int = 0) -> Lease | None:
        """Up to n tasks for `ttl_s` seconds, or None when there is nothing to hand out."""
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        with self._lock:
            self._reap()
            task_ids: list[int] = []
            while len(task_ids) < n and self._pending:
                task_ids.append(self._pending.popleft())
            while len(task_ids) < n and (
                self.max_tasks is None or self._next_task_id < self.max_tasks
            ):
                task_ids.append(self._next_task_id)
                self._next_task_id += 1
            if not task_ids:
                return None
            lease_id = self._next_lease_id
            self._next_lease_id += 1
            deadline = self._clock() + ttl_s
            self._leases[lease_id] = _LeaseState(worker_id, set(task_ids), deadline)
            for tid in task_ids:
                self._owner[tid] = lease_id
            return Lease(
                lease_id=lease_id,
                worker_id=worker_id,
                tasks=[self._ref(t) for t in task_ids],
                deadline_s=deadline,
                policy_version=policy_version,
            )

    def _live(self, lease_id: int) -> _LeaseState | None:
        st = self._leases.get(lease_id)
        if st is None:
            return None
        if st.deadline_s <= self._clock():
            self._reap()
            return None
        return st

    def ack(self, lease_id: int, group: Group) -> bool:
        """Accept `group` for its task if `lease_id` is live and holds the task; else reject."""
        tid = group.task.task_id
        with self._lock:
            st = self._live(lease_id)
            if st is None or tid not in st.task_ids or self._owner.get(tid) != lease_id:
                self._num_rejected_acks += 1
                return False
            group.lease_id = lease_id
            if self._sink is not None:
                # Under the lock: if the sink raises, the task stays leased (and will expire).
                self._sink(group)
            st.task_ids.discard(tid)
            del self._owner[tid]
            self._done.add(tid)
            if not st.task_ids:
                del self._leases[lease_id]
            return True

    def nack(self, lease_id: int, task_ids: list[int] | None = None) -> int:
        """Return the lease's unacked tasks (or just `task_ids` of them) to the queue. Returns how
        many went back; 0 for a dead lease (its tasks were already redelivered)."""
        with self._lock:
            st = self._live(lease_id)
            if st is None:
                return 0
            back = set(st.task_ids) if task_ids is None else st.task_ids & set(task_ids)
            st.task_ids -= back
            self._requeue(back)
            if not st.task_ids:
                del self._leases[lease_id]
            return len(back)

    def drop(self, lease_id: int, task_ids: list[int]) -> int:
        """Give up on tasks a live lease holds: done without a group (not redelivered). Returns
        how many were dropped; 0 for a dead lease (its tasks were already redelivered)."""
        with self._lock:
            st = self._live(lease_id)
            if st is None:
                return 0
            gone = st.task_ids & set(task_ids)
            for tid in gone:
                st.task_ids.discard(tid)
                del self._owner[tid]
                self._done.add(tid)
            if not st.task_ids:
                del self._leases[lease_id]
            self._num_dropped += len(gone)
            return len(gone)

    def extend(self, lease_id: int, ttl_s: float) -> bool:
        """Move a live lease's deadline to now + ttl_s. False if the lease is dead."""
        with self._lock:
            st = self._live(lease_id)
            if st is None:
                return False
            st.deadline_s = self._clock() + ttl_s
            return True

    def requeue(self, task_ids: list[int]) -> None:
        """Undo acks: done tasks go back to the front of the queue (the buffer dropped their
        groups as too stale, so they must be generated again, not lost)."""
        with self._lock:
            back = {t for t in task_ids if t in self._done}
            self._done -= back
            self._requeue(back)

    def is_done(self, task_id: int) -> bool:
        with self._lock:
            return task_id in self._done

    def done_ids(self) -> set[int]:
        with self._lock:
            return set(self._done)

    def lease_holders(self) -> dict[str, int]:
        """worker_id -> number of tasks it holds under live leases."""
        with self._lock:
            self._reap()
            out: dict[str, int] = {}
            for st in self._leases.values():
                out[st.worker_id] = out.get(st.worker_id, 0) + len(st.task_ids)
            return out

    def num_in_flight(self) -> int:
        with self._lock:
            self._reap()
            return len(self._owner)

    def stats(self) -> QueueStats:
        with self._lock:
            self._reap()
            return QueueStats(
                num_pending=len(self._pending),
                num_leased=len(self._owner),
                num_done=len(self._done),
                num_redelivered=self._num_redelivered,
                num_rejected_acks=self._num_rejected_acks,
                num_expired_leases=self._num_expired_leases,
                num_dropped=self._num_dropped,
            )

    def snapshot(self) -> dict[str, Any]:
        """State for a checkpoint. Leased tasks are recorded as pending (front of the queue)."""
        with self._lock:
            leased = sorted(self._owner)
            return {
                "num_prompts": self.num_prompts,
                "max_tasks": self.max_tasks,
                "pending": leased + list(self._pending),
                "next_task_id": self._next_task_id,
                "next_lease_id": self._next_lease_id,
                "done": sorted(self._done),
                "num_redelivered": self._num_redelivered,
                "num_dropped": self._num_dropped,
            }

    def restore(self, state: dict[str, Any]) -> None:
        """Replace this queue's state with a snapshot. Live leases are dropped (fenced off)."""
        with self._lock:
            if state["num_prompts"] != self.num_prompts:
                raise ValueError(
                    f"queue snapshot is for {state['num_prompts']} prompts, this queue has "
                    f"{self.num_prompts}"
                )
            self.max_tasks = state["max_tasks"]
            self._pending = deque(sorted(set(state["pending"])))
            self._next_task_id = state["next_task_id"]
            # Never reuse a lease id: leases granted after the snapshot was taken (by the process
            # that crashed) must stay fenced off, so jump to the wall clock in microseconds,
            # which is past any id handed out before (ids are issued far slower than 1/us).
            self._next_lease_id = max(
                self._next_lease_id, state["next_lease_id"], time.time_ns() // 1000
            )
            self._leases.clear()
            self._owner.clear()
            self._done = set(state["done"])
            self._num_redelivered = state.get("num_redelivered", 0)
            self._num_dropped = state.get("num_dropped", 0)
