"""A group waiting on its rewards does not hold a generation slot (issue 45: a slow reward costs
max(generation, reward) per step, not their sum): `GroupRollout.generating` turns False when the
group's requests have returned and only its environment steps run, `on_engine_idle` says so, and
the rollout worker then leases more tasks, up to `max_inflight_tasks` generating and
`max_scoring_tasks` more. Real native engine, real coordinator and queue; the reward is held on
an Event (the test's stand-in for a slow reward function, released by the test)."""

from __future__ import annotations

import threading
import time
from typing import Any

from test_envs import setup  # noqa: F401 - the module's engine fixture

from slipstream.config.rl import RolloutConfig
from slipstream.envs import EpisodeLimits, EpisodeRunner, make_env_factory
from slipstream.rl.buffer import ExperienceBuffer
from slipstream.rl.coordinator import Coordinator
from slipstream.rl.queue import TaskQueue
from slipstream.rl.types import rollout_room
from slipstream.rl.verifier import InProcessVerifier
from slipstream.rl.worker import RolloutWorker
from slipstream.tasks import Task


class HeldVerifier:
    """The task's own verifier, each call waiting until `release` is set (a slow reward)."""

    sandboxes = None

    def __init__(self, taskset: Any) -> None:
        self.inner = InProcessVerifier(taskset)
        self.release = threading.Event()
        self.waiting = 0
        self.cv = threading.Condition()

    def verify(self, task: Task, completion: str) -> tuple[float, str]:
        with self.cv:
            self.waiting += 1
            self.cv.notify_all()
        assert self.release.wait(120), "the test never released the rewards"
        with self.cv:
            self.waiting -= 1
        return self.inner.verify(task, completion)

    def score_group(self, task: Task, completions: list[str]) -> None:
        return None

    def reward_stats(self) -> dict[str, float]:
        return {}

    def close(self) -> None:
        self.release.set()
        self.inner.close()


def wait_for(cond: Any, what: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_rollout_room() -> None:
    # (max_inflight_tasks, max_held, generating, held)
    assert rollout_room(4, 6, generating=0, held=0) == 4
    assert rollout_room(4, 6, generating=4, held=4) == 0  # every generation slot taken
    assert rollout_room(4, 6, generating=2, held=4) == 2  # two only wait on their rewards
    assert rollout_room(4, 6, generating=1, held=5) == 1  # at most 4 + 2 held
    assert rollout_room(4, 6, generating=0, held=6) == 0
    assert rollout_room(4, 4, generating=0, held=4) == 0  # max_scoring_tasks = 0


def test_group_leaves_generation_while_its_rewards_run(setup) -> None:  # type: ignore[no-untyped-def] # noqa: F811
    ts, engine, pool = setup
    verifier = HeldVerifier(ts)
    limits = EpisodeLimits(max_turn_tokens=5)
    runner = EpisodeRunner(engine, make_env_factory(ts, scorer=verifier.verify, limits=limits),
                           ts.tokenizer, limits, pool, context_tokens=engine.max_seq_len)  # fmt: skip
    idle, done = threading.Event(), threading.Event()
    outcome: list[Any] = []
    rollout = runner.start(ts.train(3), 4, lambda out: (outcome.append(out), done.set()), seed=1,
                           on_engine_idle=idle.set)  # fmt: skip
    try:
        assert idle.wait(120), "the group's requests never returned"
        with verifier.cv:  # all 4 completions are in their reward calls
            assert verifier.cv.wait_for(lambda: verifier.waiting == 4, 60)
        assert not rollout.generating and not done.is_set()
        verifier.release.set()
        assert done.wait(60)
        assert outcome[0].status == "done" and len(outcome[0].episodes) == 4
        assert not rollout.generating
    finally:
        verifier.close()
        runner.close()


def test_worker_takes_more_tasks_while_rewards_are_slow(setup) -> None:  # type: ignore[no-untyped-def] # noqa: F811
    ts, engine, _ = setup
    verifier = HeldVerifier(ts)
    cfg = RolloutConfig(group_size=2, tasks_per_lease=1, max_inflight_tasks=1,
                        max_scoring_tasks=2, lease_ttl_s=60, verify_threads=8,
                        drain_timeout_s=5, max_new_tokens=5)  # fmt: skip
    coord = Coordinator(TaskQueue(ts.num_train, max_tasks=6), ExperienceBuffer(1, 64))
    worker = RolloutWorker("w0", coord, engine, ts, verifier, cfg, weights=None)  # type: ignore[arg-type]
    t = threading.Thread(target=worker.run)
    t.start()
    try:
        # one task generating at a time, but three held: two wait on their (held) rewards
        most = cfg.max_inflight_tasks + cfg.max_scoring_tasks
        wait_for(lambda: verifier.waiting == most * cfg.group_size,
                 f"the worker never held {most} tasks waiting on their rewards")  # fmt: skip
        assert coord.queue.stats().num_leased == most
        verifier.release.set()  # the rewards return: every task is acked
        wait_for(lambda: coord.queue.stats().num_done == 6, "not every task was acked")
        assert worker.stats["groups_acked"] == 6
        assert coord.queue.stats().num_leased == 0
    finally:
        worker.request_stop()
        verifier.release.set()
        t.join(60)
        verifier.close()
