"""ExperienceBuffer: staleness bound, admission control, dynamic sampling, snapshot/restore."""

from __future__ import annotations

import pytest

from slipstream.rl.buffer import ExperienceBuffer
from slipstream.rl.types import Group, Sample, TaskRef


def grp(task_id: int, versions: list[int], rewards: tuple[float, ...] = (0.0, 1.0)) -> Group:
    samples = [
        Sample([1], [5] * len(versions), [-0.5] * len(versions), list(versions), reward=r)
        for r in rewards
    ]
    return Group(task=TaskRef(task_id, task_id), samples=samples)


def test_stale_groups_are_dropped_and_never_returned() -> None:
    buf = ExperienceBuffer(groups_per_step=2, max_staleness=1)
    buf.put(grp(0, [0, 0]))
    buf.put(grp(1, [1, 2]))  # partial rollout: oldest token is version 1
    buf.put(grp(2, [2]))
    batch = buf.get_batch(2, current_version=2)
    assert batch is not None
    assert batch.task_ids == [1, 2]
    assert batch.staleness == [1, 0]
    m = buf.metrics()
    assert m["dropped_stale"] == 1 and m["wasted_samples"] == 2
    assert m["staleness_hist"] == {"0": 1, "1": 1}
    assert buf.get_batch(1, current_version=2) is None


def test_admission_capacity_formula() -> None:
    buf = ExperienceBuffer(groups_per_step=4, max_staleness=0)
    assert buf.admission_slots(current_version=0, num_in_flight=0) == 4  # sync: one batch
    assert buf.admission_slots(current_version=0, num_in_flight=3) == 1
    for t in range(4):
        buf.put(grp(t, [0]))
    assert buf.admission_slots(0, 0) == 0
    assert buf.get_batch(4, 0) is not None
    assert buf.admission_slots(0, 0) == 0  # consumed counts until the version moves on
    assert buf.admission_slots(1, 0) == 4
    buf2 = ExperienceBuffer(groups_per_step=4, max_staleness=2)
    assert buf2.admission_slots(0, 0) == 12
    assert buf2.admission_slots(5, 10) == 32 - 10


def test_dynamic_sampling_drops_uniform_groups_and_frees_slots() -> None:
    buf = ExperienceBuffer(groups_per_step=2, max_staleness=0, dynamic_sampling=True)
    assert not buf.put(grp(0, [0], rewards=(1.0, 1.0)))
    assert buf.put(grp(1, [0], rewards=(0.0, 1.0)))
    assert buf.metrics()["dropped_uniform"] == 1
    assert buf.admission_slots(0, 0) == 1  # the dropped group's slot is free again


def test_snapshot_restore_roundtrip() -> None:
    buf = ExperienceBuffer(groups_per_step=2, max_staleness=3)
    buf.put(grp(0, [0]))
    buf.put(grp(1, [1]))
    buf.get_batch(1, 1)
    buf.put(grp(2, [1, 1]))
    snap = buf.snapshot()
    buf2 = ExperienceBuffer(groups_per_step=2, max_staleness=3)
    buf2.restore(snap)
    assert buf2.metrics() == buf.metrics()
    assert buf2.get_batch(2, 1).task_ids == [1, 2]


def test_empty_group_rejected() -> None:
    with pytest.raises(ValueError, match="task 7"):
        ExperienceBuffer(1, 0).put(Group(task=TaskRef(7, 7), samples=[]))


def test_stale_groups_are_requeued_through_the_coordinator() -> None:
    from slipstream.rl.coordinator import Coordinator
    from slipstream.rl.queue import TaskQueue

    coord = Coordinator(
        TaskQueue(10, max_tasks=4), ExperienceBuffer(groups_per_step=2, max_staleness=0)
    )
    lease = coord.lease("w", 4, ttl_s=60)
    assert [t.task_id for t in lease.tasks] == [0, 1]  # admission: one batch at staleness 0
    assert coord.lease("w", 4, ttl_s=60) is None
    assert coord.ack(lease.lease_id, grp(0, [0]))
    coord.set_version(1)  # as if the trainer moved on: task 0's group is now too stale
    assert coord.get_batch(1, timeout_s=0) is None
    assert not coord.queue.is_done(0)
    assert coord.buffer.metrics()["dropped_stale"] == 1
    again = coord.lease("w2", 1, ttl_s=60)
    assert [t.task_id for t in again.tasks] == [0]  # regenerated, not lost
