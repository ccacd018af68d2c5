"""TaskQueue lease semantics: fencing, expiry redelivery, nack, extend, snapshot/restore; property
tests (hypothesis) sequentially with a controlled clock and under real thread concurrency."""

from __future__ import annotations

import random
import threading
import time

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from slipstream.rl.queue import TaskQueue
from slipstream.rl.types import Group, Sample, TaskRef


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def group(task: TaskRef) -> Group:
    return Group(task=task, samples=[Sample([1], [2], [-0.1], [0], reward=1.0)])


def test_ack_from_expired_lease_is_rejected_and_task_redelivered() -> None:
    clock = Clock()
    sunk: list[int] = []
    q = TaskQueue(10, max_tasks=3, sink=lambda g: sunk.append(g.task.task_id), clock=clock)
    a = q.lease("a", 2, ttl_s=5)
    assert [t.task_id for t in a.tasks] == [0, 1]
    clock.t = 6  # a's lease expires before it acks
    b = q.lease("b", 3, ttl_s=5)
    assert [t.task_id for t in b.tasks] == [0, 1, 2]  # redelivered first
    assert not q.ack(a.lease_id, group(a.tasks[0]))  # fenced
    assert q.ack(b.lease_id, group(b.tasks[0]))
    assert not q.ack(b.lease_id, group(b.tasks[0]))  # twice: rejected
    assert sunk == [0]
    assert q.stats().num_rejected_acks == 2


def test_nack_extend_and_dead_lease() -> None:
    clock = Clock()
    q = TaskQueue(10, max_tasks=4, clock=clock)
    a = q.lease("a", 4, ttl_s=5)
    clock.t = 4
    assert q.extend(a.lease_id, 5)  # now deadline 9
    clock.t = 8
    assert q.ack(a.lease_id, group(a.tasks[0]))
    assert q.nack(a.lease_id, [1]) == 1
    b = q.lease("b", 1, ttl_s=5)
    assert [t.task_id for t in b.tasks] == [1]
    clock.t = 9.5
    assert not q.extend(a.lease_id, 5)
    assert q.nack(a.lease_id) == 0
    c = q.lease("c", 10, ttl_s=5)
    assert sorted(t.task_id for t in c.tasks) == [2, 3]  # b still holds 1


def test_snapshot_restore_fences_old_leases_and_keeps_tasks() -> None:
    q = TaskQueue(5, max_tasks=6)
    a = q.lease("a", 3, ttl_s=60)
    assert q.ack(a.lease_id, group(a.tasks[0]))
    snap = q.snapshot()
    q2 = TaskQueue(5)
    q2.restore(snap)
    assert not q2.ack(a.lease_id, group(a.tasks[1]))  # lease from before the restore
    lease = q2.lease("b", 10, ttl_s=60)
    assert [t.task_id for t in lease.tasks] == [1, 2, 3, 4, 5]
    assert [t.index for t in lease.tasks] == [1, 2, 3, 4, 0]
    assert q2.done_ids() == {0}


class QueueMachine(RuleBasedStateMachine):
    """Random lease/ack/nack/extend/time steps; every task is exactly one of pending, leased, done,
    and the sink sees each task at most once."""

    def __init__(self) -> None:
        super().__init__()
        self.clock = Clock()
        self.sunk: list[int] = []
        self.q = TaskQueue(
            7, max_tasks=12, sink=lambda g: self.sunk.append(g.task.task_id), clock=self.clock
        )
        self.leases = []

    @rule(n=st.integers(1, 5), ttl=st.floats(0.5, 5))
    def lease(self, n: int, ttl: float) -> None:
        lease = self.q.lease(f"w{len(self.leases)}", n, ttl)
        if lease is not None:
            self.leases.append(lease)

    @precondition(lambda self: self.leases)
    @rule(i=st.integers(0, 100), j=st.integers(0, 100))
    def ack(self, i: int, j: int) -> None:
        lease = self.leases[i % len(self.leases)]
        task = lease.tasks[j % len(lease.tasks)]
        was_done = self.q.is_done(task.task_id)
        live = lease.deadline_s > self.clock.t
        ok = self.q.ack(lease.lease_id, group(task))
        if was_done or not live:
            assert not ok

    @precondition(lambda self: self.leases)
    @rule(i=st.integers(0, 100))
    def nack(self, i: int) -> None:
        self.q.nack(self.leases[i % len(self.leases)].lease_id)

    @precondition(lambda self: self.leases)
    @rule(i=st.integers(0, 100), ttl=st.floats(0.5, 5))
    def extend(self, i: int, ttl: float) -> None:
        lease = self.leases[i % len(self.leases)]
        if self.q.extend(lease.lease_id, ttl):
            lease.deadline_s = self.clock.t + ttl

    @rule(dt=st.floats(0, 3))
    def tick(self, dt: float) -> None:
        self.clock.t += dt

    @rule()
    def snapshot_restore(self) -> None:
        snap = self.q.snapshot()
        self.q.restore(snap)
        for lease in self.leases:
            lease.deadline_s = -1.0  # all fenced off now

    @invariant()
    def exactly_one_state(self) -> None:
        assert len(self.sunk) == len(set(self.sunk))
        assert set(self.sunk) == self.q.done_ids()
        snap = self.q.snapshot()
        pending = snap["pending"]
        assert len(pending) == len(set(pending))
        assert not set(pending) & set(snap["done"])
        assert set(pending) | set(snap["done"]) == set(range(snap["next_task_id"]))


TestQueueMachine = QueueMachine.TestCase
TestQueueMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**16), num_workers=st.integers(2, 5))
def test_concurrent_workers_each_task_sunk_exactly_once(seed: int, num_workers: int) -> None:
    """Threads lease with a short TTL, sometimes stall past it, sometimes nack or die silently;
    every task ends up in the sink exactly once."""
    num_tasks = 30
    sunk: list[int] = []
    lock = threading.Lock()

    def sink(g: Group) -> None:
        with lock:
            sunk.append(g.task.task_id)

    q = TaskQueue(11, max_tasks=num_tasks, sink=sink)

    def worker(wid: int) -> None:
        rng = random.Random(seed * 100 + wid)
        while len(q.done_ids()) < num_tasks:
            lease = q.lease(f"w{wid}", rng.randint(1, 3), ttl_s=0.02)
            if lease is None:
                time.sleep(0.002)
                continue
            for task in lease.tasks:
                r = rng.random()
                if r < 0.1:
                    time.sleep(0.03)  # stall past the ttl: acks must now be rejected
                elif r < 0.15:
                    q.nack(lease.lease_id, [task.task_id])
                    continue
                elif r < 0.2:
                    break  # "die": drop the rest of the lease on the floor
                q.ack(lease.lease_id, group(task))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(num_workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert sorted(sunk) == list(range(num_tasks))
