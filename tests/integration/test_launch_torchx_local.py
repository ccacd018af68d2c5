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


def _worker_process(port: int, slot: int) -> int:
    """The pid of the rollout worker (the python process, not its bash) of this job's slot."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if (b"slipstream.launch.worker" in argv and b"--slot" in argv
                and argv[argv.index(b"--slot") + 1] == str(slot).encode()
                and any(a.endswith(f":{port}".encode()) for a in argv)):  # fmt: skip
            return int(proc.name)
    raise LookupError(f"no rollout worker of slot {slot} on port {port}")


def test_a_terminated_rollout_worker_is_replaced_while_the_trainer_runs(tmp_path: Path) -> None:
    """What a Spot interruption is to the rollout role: SIGTERM drains the job's only worker (exit
    0) and the trainer waits; the replacement the scheduler would start (here: the test, with the
    worker's command line and environment) joins the running job, which then finishes every step
    (it could not without it), each task once, one restart counted."""
    import signal
    import time

    save_random_init(tmp_path / "init", TINY)
    (tmp_path / "empty.toml").write_text("")
    bin_dir, port = Path(sys.executable).parent, free_port()
    overrides = [o for o in TINY if not o.startswith("trainer.steps=")] + ["trainer.steps=8"]
    cmd = [
        str(bin_dir / "torchx"), "run", "-s", "local_cwd", "-cfg", f"log_dir={tmp_path / 'logs'}",
        f"{REPO / 'src/slipstream/launch/torchx.py'}:rl", "-j", "1x1",
        "--num_rollout_workers", "1", "--config", str(tmp_path / "empty.toml"),
        "--coordinator_port", str(port), "--",
        *(f"--{o}" for o in overrides), f"--run.output_dir={tmp_path / 'run'}",
        f"--model.init_from={tmp_path / 'init'}",
    ]  # fmt: skip
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
    with open(tmp_path / "torchx.log", "wb") as log:
        job = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                               start_new_session=True)  # fmt: skip
    replacement = None
    try:
        deadline = time.monotonic() + 120
        while 2 not in trained_steps(tmp_path / "run" / "metrics.jsonl"):  # w0 has worked
            assert job.poll() is None and time.monotonic() < deadline, (
                (tmp_path / "torchx.log").read_text()[-4000:])  # fmt: skip
            time.sleep(0.2)
        pid = _worker_process(port, 0)
        argv = [a.decode() for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") if a]
        raw_env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        worker_env = dict(kv.decode().split("=", 1) for kv in raw_env if b"=" in kv)
        os.kill(pid, signal.SIGTERM)  # the pod's termination notice
        with open(tmp_path / "replacement.log", "wb") as rlog:
            replacement = subprocess.Popen(
                [*argv, "--coordinator-wait-s", "60"], cwd=REPO, env=worker_env, stdout=rlog,
                stderr=subprocess.STDOUT,
            )  # fmt: skip
        assert job.wait(timeout=180) == 0, (tmp_path / "torchx.log").read_text()[-4000:]
        assert replacement.wait(timeout=60) == 0, (tmp_path / "replacement.log").read_text()
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
        if replacement is not None and replacement.poll() is None:
            replacement.kill()
            replacement.wait()
    log = (tmp_path / "torchx.log").read_text()
    assert "Job finished: SUCCEEDED" in log, log[-4000:]
    assert re.search(r"rollout/0 .* w0\.\d+ INFO exiting 0", log), log[-4000:]  # it drained
    assert "INFO exiting 0" in (tmp_path / "replacement.log").read_text()
    steps = trained_steps(tmp_path / "run" / "metrics.jsonl")
    assert sorted(steps) == list(range(1, 9))
    trained = [t for s in sorted(steps) for t in steps[s]["task_ids"]]
    assert len(trained) == len(set(trained)), trained
    report = (tmp_path / "run" / "report.md").read_text()
    assert "**worker restarts**: 1" in report, report
