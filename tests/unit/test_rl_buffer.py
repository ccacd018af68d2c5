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


SIGNAL, UNIFORM = (0.0, 1.0), (1.0, 1.0)


def test_dynamic_sampling_drops_uniform_groups_and_frees_slots() -> None:
    buf = ExperienceBuffer(groups_per_step=2, max_staleness=0, dynamic_sampling=True,
                           signal_window_groups=1)  # fmt: skip
    assert buf.put(grp(0, [0], rewards=SIGNAL))
    assert not buf.put(grp(1, [0], rewards=UNIFORM))
    assert buf.metrics()["dropped_uniform"] == 1
    assert buf.admission_slots(0, 0) == 1  # the dropped group's slot is free again


def test_dynamic_sampling_refills_only_while_the_signal_share_affords_it() -> None:
    """Nothing is dropped until the window is full; then a uniform group is dropped only while
    >= min_signal_share of the last window groups (kept or dropped) had signal."""
    buf = ExperienceBuffer(groups_per_step=4, max_staleness=0, dynamic_sampling=True,
                           min_signal_share=0.25, signal_window_groups=4)  # fmt: skip
    kept = [buf.put(grp(t, [0], rewards=UNIFORM)) for t in range(6)]
    assert kept == [True] * 6  # window not full, then share 0: a random init trains as before
    assert buf.metrics()["kept_uniform"] == 6 and buf.metrics()["dropped_uniform"] == 0
    assert buf.put(grp(6, [0], rewards=SIGNAL))  # window: U U U S -> share 0.25
    assert not buf.put(grp(7, [0], rewards=UNIFORM))  # affordable: dropped
    assert not buf.put(grp(8, [0], rewards=UNIFORM))  # U U S U -> 0.25: dropped
    assert not buf.put(grp(9, [0], rewards=UNIFORM))  # U S U U: dropped
    assert not buf.put(grp(10, [0], rewards=UNIFORM))  # S U U U: the signal's last turn
    assert buf.put(grp(11, [0], rewards=UNIFORM))  # U U U U -> share 0: trained
    m = buf.metrics()
    assert (m["dropped_uniform"], m["kept_uniform"], m["wasted_samples"]) == (4, 7, 8)
    assert m["signal_share"] == 0.0


def test_dynamic_sampling_never_stalls_a_batch_when_no_group_has_signal() -> None:
    """A random initialisation: every reward 0. The batch fills after exactly groups_per_step
    groups once the window shows no signal, instead of dropping forever."""
    buf = ExperienceBuffer(groups_per_step=8, max_staleness=0, dynamic_sampling=True)
    for t in range(8):
        buf.put(grp(t, [0], rewards=(0.0,) * 8))
    assert buf.get_batch(8, 0) is not None


@pytest.mark.parametrize("share, window", [(0.0, 4), (1.5, 4), (0.5, 0)])
def test_dynamic_sampling_bounds_are_checked(share: float, window: int) -> None:
    with pytest.raises(ValueError, match="min_signal_share"):
        ExperienceBuffer(2, 0, dynamic_sampling=True, min_signal_share=share,
                         signal_window_groups=window)  # fmt: skip


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
    assert buf2.snapshot()["signal_window"] == [True, True, True]
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
