"""The TorchX component end to end on this machine: `torchx run -s local_cwd
src/slipstream/launch/torchx.py:rl -j 1x2 --num_rollout_workers 2` (the torchx CLI, as a user types
it) starts the trainer role (torchrun, two gloo ranks, rank 0 the job) and the rollout role (two
worker processes that find rank 0's coordinator by TorchX's rank-0 host and the port the
component set); the job trains every step on each task once, evaluates, writes its report, and
every process exits 0 so TorchX reports SUCCEEDED. A tiny random model: a few seconds of work."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from jobutil import TINY_MODEL, save_random_init, trained_steps
from s3util import free_port

pytestmark = pytest.mark.slow
pytest.importorskip("torchx")

REPO = Path(__file__).resolve().parents[2]
TINY = [
    *TINY_MODEL, "trainer.mode=sync", "trainer.groups_per_step=2", "rollout.group_size=4",
    "trainer.lr=0.01", "rollout.lease_ttl_s=3", "rollout.drain_timeout_s=5",
    "trainer.skip_no_signal=false", "trainer.checkpoint_every=0", "trainer.steps=4",
]  # fmt: skip


def test_local_cwd_job_trains_and_evaluates_with_separate_roles(tmp_path: Path) -> None:
    save_random_init(tmp_path / "init", TINY)
    (tmp_path / "empty.toml").write_text("")
    bin_dir = Path(sys.executable).parent  # torchx, torchrun, slipstream, python
    cmd = [
        str(bin_dir / "torchx"), "run", "-s", "local_cwd", "-cfg", f"log_dir={tmp_path / 'logs'}",
        f"{REPO / 'src/slipstream/launch/torchx.py'}:rl", "-j", "1x2",
        "--num_rollout_workers", "2", "--config", str(tmp_path / "empty.toml"),
        "--coordinator_port", str(free_port()), "--",
        *(f"--{o}" for o in TINY), f"--run.output_dir={tmp_path / 'run'}",
        f"--model.init_from={tmp_path / 'init'}",
    ]  # fmt: skip
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-4000:]
    assert "Job finished: SUCCEEDED" in log, log[-4000:]
    steps = trained_steps(tmp_path / "run" / "metrics.jsonl")
    assert sorted(steps) == [1, 2, 3, 4], log[-4000:]
    trained = [t for s in sorted(steps) for t in steps[s]["task_ids"]]
    assert len(trained) == len(set(trained)), trained  # each task trained once
    # both workers of the rollout role ran against rank 0's coordinator and drained to exit 0
    for slot in (0, 1):
        assert re.search(rf"rollout/{slot} .* w{slot}\.\d+ INFO exiting 0", log), log[-4000:]
    assert re.search(r"rank1 INFO done after 4 steps", log), log[-4000:]  # the follower rank
    report = (tmp_path / "run" / "report.md").read_text()
    assert "held-out pass@1 before" in report and "held-out pass@1 after" in report
    assert re.search(r"rollout workers seen.*w0\.\d+.*w1\.\d+", report), report
