"""Episode accounting: what the run's report shows about rollouts (turns and tool calls per
episode, sandbox acquire p50/p99, infrastructure failures, re-run episodes, dropped tasks) from
the buffer, through a checkpoint snapshot; TaskQueue/Coordinator.drop gives up on a leased task
without a group (done, never redelivered, its admission slot freed)."""

from __future__ import annotations

from slipstream.rl.buffer import ExperienceBuffer, group_from_dict, group_to_dict
from slipstream.rl.coordinator import Coordinator
from slipstream.rl.queue import TaskQueue
from slipstream.rl.types import Group, Sample, TaskRef


def episode(tool_calls: int, acquire_s: float, retries: int = 0) -> Sample:
    return Sample([1, 3], [4, 11, 12, 5], [-1.0, -1.0], [0, 0], reward=1.0, loss_mask=[1, 0, 0, 1],
                  num_turns=2, tool_calls=tool_calls, env_s=0.5, sandbox_acquire_s=acquire_s,
                  infra_retries=retries)  # fmt: skip


def test_buffer_counts_episodes_and_survives_a_snapshot() -> None:
    buf = ExperienceBuffer(1, 2)
    buf.put(Group(TaskRef(0, 0), [episode(1, 0.01), episode(0, 0.02, retries=2)]))
    buf.put(Group(TaskRef(1, 1), [episode(2, 0.03), Sample([1], [5], [-1.0], [0])]))
    buf.count_dropped_infra(1, 3)
    m = buf.metrics()
    assert m["episodes"] == 4 and m["turns_per_episode"] == (2 + 2 + 2 + 1) / 4
    assert m["tool_calls_per_episode"] == 3 / 4 and m["observation_tokens_per_episode"] == 6 / 4
    assert m["sandbox_acquire_p50_s"] == 0.02 and m["sandbox_acquire_p99_s"] == 0.03
    assert m["infra_failures"] == 2 + 3 and m["infra_retried_episodes"] == 1
    assert m["dropped_infra"] == 1
    again = ExperienceBuffer(1, 2)
    again.restore(buf.snapshot())
    assert again.metrics() == m
    legacy = buf.snapshot()
    del legacy["episode_counts"], legacy["acquire_s"]  # a checkpoint from before
    again.restore(legacy)
    assert again.metrics()["episodes"] == 0
    g = Group(TaskRef(0, 0), [episode(1, 0.01)])
    assert group_from_dict(group_to_dict(g)).samples == g.samples  # masks and fields round-trip


def test_drop_gives_up_on_a_leased_task_without_a_group() -> None:
    queue = TaskQueue(10, max_tasks=3)
    buf = ExperienceBuffer(2, 0)  # admission: 2 tasks may be out at version 0
    coord = Coordinator(queue, buf)
    lease = coord.lease("w", 2, 60.0)
    assert lease is not None and coord.lease("w", 1, 60.0) is None  # admission is full
    t0, t1 = (t.task_id for t in lease.tasks)
    assert coord.drop(lease.lease_id, [t0], infra_failures=3) == 1
    assert coord.drop(lease.lease_id, [t0]) == 0  # already gone
    assert queue.is_done(t0) and not queue.is_done(t1)
    st = coord.status()
    assert st.dropped_tasks == 1 and st.buffer["dropped_infra"] == 1
    assert st.buffer["infra_failures"] == 3 and len(buf) == 0
    coord.nack(lease.lease_id)
    leased = []
    while (nxt := coord.lease("w", 1, 60.0)) is not None:  # the dropped task's slot is free
        leased += [t.task_id for t in nxt.tasks]
        coord.drop(nxt.lease_id, [t.task_id for t in nxt.tasks])
    assert t0 not in leased and t1 in leased and len(leased) == 2  # never redelivered
    restored = TaskQueue(10)
    restored.restore(queue.snapshot())
    assert restored.stats().num_dropped == queue.stats().num_dropped == 3
