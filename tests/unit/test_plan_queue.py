"""The planner's coordinator (plan/loop.py) against the real one: the simulator's every queue and
buffer call is recorded and replayed on `slipstream.rl.coordinator.Coordinator` (TaskQueue +
ExperienceBuffer) with a controlled clock; each result must be identical. Runs with Spot
interruptions (drain nacks and reclaims whose leases expire), stale drops and several instances,
and checks that no group is lost or trained twice."""

from __future__ import annotations

import random

import pytest

from slipstream.plan import PlanConfig, Simulator, with_overrides
from slipstream.plan.loop import INFINITE_TTL_S, LoopState
from slipstream.rl.buffer import ExperienceBuffer
from slipstream.rl.coordinator import Coordinator
from slipstream.rl.queue import TaskQueue
from slipstream.rl.types import Group, Sample, TaskRef

HEAVY = 'verifier.latency_s={kind="lognormal", p50=0.25, p99_over_p50=5.0}'
SPOT = [
    "rollout.spot_fraction=1", "rollout.spot.interruptions_per_node_hour=400",
    "rollout.spot.notice_s=1.0", "rollout.spot.replace_s=0.5", "rollout.lease_ttl_s=2.0",
]  # fmt: skip

CASES = {
    "spot-drain": [
        HEAVY,
        *SPOT,
        "rollout.spot.drain_timeout_s=0.2",
        "rollout.num_instances=3",
        "loop.steps=120",
    ],  # fmt: skip
    # drain longer than the notice: reclaimed nodes' leases must expire and be redelivered
    "spot-reclaim": [
        HEAVY,
        *SPOT,
        "rollout.spot.drain_timeout_s=5",
        "rollout.num_instances=3",
        "loop.steps=120",
    ],  # fmt: skip
    "stale-drops": [HEAVY, "rollout.num_instances=2", "loop.max_staleness=1", "loop.steps=150"],
    "sync": ["loop.mode=sync", "rollout.num_instances=2", "loop.steps=60"],
}


def replay(loop: LoopState, trace: list[tuple]) -> Coordinator:
    """Apply the recorded calls to a real Coordinator; assert every result matches."""
    clock = [0.0]
    queue = TaskQueue(1 << 40, clock=lambda: clock[0])
    coord = Coordinator(queue, ExperienceBuffer(loop.groups_per_step, loop.max_staleness))
    for op in trace:
        kind, clock[0] = op[0], op[1]
        if kind == "lease":
            _, _, worker, n, expected = op
            lease = coord.lease(worker, n, INFINITE_TTL_S)
            got = None if lease is None else (lease.lease_id, [t.task_id for t in lease.tasks])
            assert got == expected, op
        elif kind == "ack":
            _, _, lease_id, task_id, oldest, expected = op
            sample = Sample([1], [2], [-0.5], [oldest], reward=1.0)
            group = Group(TaskRef(task_id, task_id), [sample] * loop.group_size)
            assert coord.ack(lease_id, group) == expected, op
        elif kind == "nack":
            _, _, lease_id, task_ids, expected = op
            assert coord.nack(lease_id, task_ids) == expected, op
        elif kind == "extend":
            _, _, lease_id, ttl_s, expected = op
            assert coord.extend(lease_id, ttl_s) == expected, op
        elif kind == "reap":
            queue.num_in_flight()
        elif kind == "get_batch":
            _, _, n, expected, stale = op
            before = coord.buffer.num_dropped_stale
            batch = coord.get_batch(n, timeout_s=0.0)
            assert (None if batch is None else batch.task_ids) == expected, op
            assert coord.buffer.num_dropped_stale - before == len(stale), op
        elif kind == "set_version":
            coord.set_version(op[2])
        else:
            raise AssertionError(f"unknown trace entry {op}")
    return coord


@pytest.mark.parametrize("name", sorted(CASES))
def test_trace_replays_identically_on_the_real_coordinator(name: str) -> None:
    sim = Simulator(with_overrides(PlanConfig(), CASES[name]), record_trace=True)
    res = sim.run()
    loop = sim.loop
    coord = replay(loop, loop.trace)
    # the real queue ends in the same state
    stats = coord.queue.stats()
    assert stats.num_pending == loop.num_pending
    assert stats.num_leased == loop.num_leased()
    assert coord.queue.done_ids() == loop.done_ids()
    assert len(coord.buffer) == loop.num_buffered
    assert coord.buffer.num_consumed == loop.num_consumed
    if name.startswith("spot"):
        assert res.interruptions > 0 and res.nacked_tasks + res.abandoned_tasks > 0
    if name == "spot-reclaim":
        assert res.expired_leases > 0
    if name == "stale-drops":
        assert res.dropped_stale_groups > 0


@pytest.mark.parametrize("name", sorted(CASES))
def test_no_group_lost_or_trained_twice(name: str) -> None:
    sim = Simulator(with_overrides(PlanConfig(), CASES[name]))
    sim.run()
    loop = sim.loop
    trained = loop.trained_task_ids
    assert len(trained) == len(set(trained)), "a task was trained twice"
    buffered = {tid for _, tid in loop._groups}
    pending = set(loop._pending)
    leased = set(loop._owner)
    everything = set(range(loop._next_task_id))
    parts = [set(trained), buffered, pending, leased]
    assert sum(len(p) for p in parts) == len(everything), "a task is in two places"
    assert set().union(*parts) == everything, "a task was lost"
    assert len(trained) == sim.plan.loop.steps * sim.plan.loop.groups_per_step


def test_admission_slots_equal_the_real_buffer_formula() -> None:
    rng = random.Random(0)
    for _ in range(300):
        gps, bound = rng.randint(1, 16), rng.randint(0, 4)
        loop = LoopState(gps, bound, group_size=2)
        real = ExperienceBuffer(gps, bound)
        loop.version = rng.randint(0, 50)
        real.num_consumed = loop.num_consumed = rng.randint(0, gps * (loop.version + 1))
        for tid in range(rng.randint(0, 3 * gps)):
            loop._groups.append((loop.version, tid))
            real.put(Group(TaskRef(tid, tid), [Sample([1], [2], [-0.1], [loop.version])]))
        in_flight = rng.randint(0, 3 * gps)
        for tid in range(in_flight):
            loop._owner[10_000 + tid] = 1
        assert loop.admission_slots(0.0) == real.admission_slots(loop.version, in_flight)
