"""reward.server = "ray_actor": the job (run.launcher = "ray", a real subprocess on a private Ray
instance) serves the reward model from a Ray actor of its own and the rollout actors score every
completion there: all steps train, every reward is the RM's sigmoid (in (0, 1)), the report names
the actor's URL, and the config refuses the server without the Ray launcher."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest
import torch

from jobutil import TINY_MODEL, job_cmd, save_random_init, trained_steps
from slipstream.config import ConfigError, load_config
from slipstream.rm.model import MoERewardModel, save_reward_model
from slipstream.tasks import get_taskset

pytestmark = [pytest.mark.ray, pytest.mark.slow]

ray = pytest.importorskip("ray")

TINY = [
    *TINY_MODEL, "trainer.mode=sync", "trainer.groups_per_step=2", "rollout.group_size=4",
    "rollout.num_workers=1", "rollout.lease_ttl_s=10", "rollout.drain_timeout_s=5",
    "trainer.skip_no_signal=false", "trainer.checkpoint_every=0", "run.launcher=ray",
]  # fmt: skip


def test_reward_model_served_by_its_own_ray_actor(tmp_path: Path) -> None:
    cfg = load_config(None, TINY)
    tok = get_taskset(cfg.task).tokenizer
    torch.manual_seed(0)
    rm = MoERewardModel(cfg.model.model_copy(update={"vocab_size": tok.vocab_size})).eval()
    save_reward_model(rm, tmp_path / "rm", tok)
    save_random_init(tmp_path / "init", TINY)
    overrides = [*TINY, "trainer.steps=3", "reward.source=reward_model",
                 f"reward.model={tmp_path / 'rm'}", "reward.server=ray_actor"]  # fmt: skip
    cmd = job_cmd(tmp_path, tmp_path / "run", overrides)
    env = dict(os.environ, OMP_NUM_THREADS="1", RAY_DISABLE_USAGE_STATS="1")
    env.pop("RAY_ADDRESS", None)
    job = subprocess.Popen(cmd, env=env, start_new_session=True, stdout=subprocess.DEVNULL,
                           stderr=open(tmp_path / "job.err", "wb"))  # fmt: skip
    try:
        assert job.wait(timeout=240) == 0, (tmp_path / "job.err").read_text()[-3000:]
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
    steps = trained_steps(tmp_path / "run" / "metrics.jsonl")
    assert sorted(steps) == [1, 2, 3]
    assert all(0 < s["reward_mean"] < 1 for s in steps.values())
    report = (tmp_path / "run" / "report.md").read_text()
    assert "**reward model server (Ray actor)**: http://" in report
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert records


def test_ray_actor_server_needs_the_ray_launcher() -> None:
    with pytest.raises(ConfigError, match="reward.server = 'ray_actor' needs run.launcher = 'ray'"):
        load_config(None, ["reward.source=reward_model", "reward.server=ray_actor"])
    with pytest.raises(ConfigError, match="an empty reward.url"):
        load_config(None, ["run.launcher=ray", "reward.source=reward_model",
                           "reward.server=ray_actor", "reward.url=http://x:1"])  # fmt: skip
