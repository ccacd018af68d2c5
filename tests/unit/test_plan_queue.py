"""The simulator drives the real coordinator (`rl/coordinator.py` over `TaskQueue` and
`ExperienceBuffer`) on its simulated clock. Runs with Spot interruptions (drain nacks and
reclaims whose leases expire at their simulated deadline), stale drops and several instances,
and checks that no group is lost or trained twice."""

from __future__ import annotations

import pytest

from slipstream.plan import PlanConfig, Simulator, with_overrides
from slipstream.rl.coordinator import Coordinator

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


@pytest.mark.parametrize("name", sorted(CASES))
def test_no_group_lost_or_trained_twice(name: str) -> None:
    sim = Simulator(with_overrides(PlanConfig(), CASES[name]))
    res = sim.run()
    assert isinstance(sim.coordinator, Coordinator)
    trained = sim.trained_task_ids
    assert len(trained) == len(set(trained)), "a task was trained twice"
    assert len(trained) == sim.plan.loop.steps * sim.plan.loop.groups_per_step
    queue = sim.queue.snapshot()  # leased tasks are listed as pending
    buffered = {g["task"]["task_id"] for g in sim.buffer.snapshot()["groups"]}
    done, not_done = set(queue["done"]), set(queue["pending"])
    assert done == set(trained) | buffered, "an acked group is neither trained nor buffered"
    assert not done & not_done and not set(trained) & buffered, "a task is in two places"
    assert done | not_done == set(range(queue["next_task_id"])), "a task was lost"
    assert sim.buffer.num_consumed == len(trained)
    if name.startswith("spot"):
        assert res.interruptions > 0 and res.nacked_tasks + res.abandoned_tasks > 0
    if name == "spot-reclaim":
        assert res.expired_leases > 0
        assert sim.queue.stats().num_redelivered > 0
    if name == "stale-drops":
        assert res.dropped_stale_groups > 0
    if name == "sync":
        assert set(res.staleness_hist) == {0}


def test_the_queue_reads_the_simulated_clock() -> None:
    sim = Simulator(with_overrides(PlanConfig(), ["loop.steps=3", "loop.warmup_steps=1"]))
    sim.run()
    assert sim.now > 0
    lease = sim.queue.lease("probe", 1, ttl_s=2.0)
    assert lease is not None and lease.deadline_s == sim.now + 2.0
    expired = sim.queue.stats().num_expired_leases
    sim.now += 1.0
    assert sim.queue.extend(lease.lease_id, 1.0)  # deadline now sim.now + 1.0
    sim.now += 1.0  # reached: the lease is dead, its task pending again
    assert not sim.queue.extend(lease.lease_id, 1.0)
    assert sim.queue.stats().num_expired_leases == expired + 1
    assert "probe" not in sim.queue.lease_holders()
