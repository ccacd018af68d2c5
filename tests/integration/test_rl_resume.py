"""Trainer kill-and-resume with real processes: the job (trainer + rollout worker processes) is
killed with SIGKILL at a random step and restarted; the resumed run continues from its last
checkpoint and, in deterministic mode, reproduces the uninterrupted run's per-step losses, task
ids and rewards exactly (so no task was lost or repeated)."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest

from jobutil import TINY_MODEL, job_cmd, save_random_init, trained_steps

TINY = [
    *TINY_MODEL, "trainer.mode=sync", "trainer.deterministic=true", "trainer.steps=6",
    "trainer.checkpoint_every=1", "trainer.groups_per_step=2", "rollout.group_size=4",
    "rollout.num_workers=1", "trainer.lr=0.01", "rollout.lease_ttl_s=5",
    # a random tiny model earns no reward: step anyway, so every step has a loss to compare
    "trainer.skip_no_signal=false",
]  # fmt: skip


def start(tmp: Path, out: str, store: list[str], env: dict[str, str]) -> subprocess.Popen:
    cmd = job_cmd(tmp, tmp / out, [*TINY, *[o.replace("{out}", out) for o in store]])
    env = dict(os.environ, OMP_NUM_THREADS="1", **env)
    return subprocess.Popen(cmd, env=env, start_new_session=True, stdout=subprocess.DEVNULL,
                            stderr=open(tmp / f"{out}.err", "wb"))  # fmt: skip


def test_kill_and_resume_reproduces_losses(tmp_path: Path) -> None:
    """Weights and checkpoints in <output_dir>/store (the default file store)."""
    kill_and_resume(tmp_path, store=[], env={})


@pytest.mark.slow
def test_kill_and_resume_with_the_store_on_s3(tmp_path: Path, moto: int) -> None:
    """The same on s3:// (a real moto server on loopback): the job publishes weights and
    checkpoints there, workers load weights from there, and the resumed trainer restores from there;
    nothing of the run's state is on local disk but logs and metrics."""
    from s3util import make_bucket, s3_options
    from slipstream.storage import CheckpointStore, WeightStore

    make_bucket(moto)
    store = ["store.url=s3://bucket/{out}", f"store.endpoint_url=http://127.0.0.1:{moto}"]
    creds = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
             "AWS_DEFAULT_REGION": "us-west-2"}  # fmt: skip
    kill_and_resume(tmp_path, store=store, env=creds)
    assert not (tmp_path / "b" / "store").exists()
    weights = WeightStore("s3://bucket/b", keep_last=3, storage_options=s3_options(moto))
    assert weights.latest() == 6
    assert CheckpointStore(weights.blob, 2).steps()[-1] == 6


def kill_and_resume(tmp_path: Path, store: list[str], env: dict[str, str]) -> None:
    save_random_init(tmp_path / "init", TINY)

    full = start(tmp_path, "a", store, env)
    crash = start(tmp_path, "b", store, env)
    kill_at = random.Random().randint(2, 4)
    metrics_b = tmp_path / "b" / "metrics.jsonl"
    deadline = time.monotonic() + 180
    try:
        while not (metrics_b.exists() and max(trained_steps(metrics_b), default=0) >= kill_at):
            assert crash.poll() is None, (tmp_path / "b.err").read_text()[-3000:]
            assert time.monotonic() < deadline
            time.sleep(0.05)
        os.kill(crash.pid, signal.SIGKILL)  # the trainer only; its workers lose their coordinator
        crash.wait()
        time.sleep(1.0)
        resumed = start(tmp_path, "b", store, env)
        assert resumed.wait(timeout=240) == 0, (tmp_path / "b.err").read_text()[-3000:]
        assert "resumed from checkpoint step" in (tmp_path / "b.err").read_text()
        assert full.wait(timeout=240) == 0, (tmp_path / "a.err").read_text()[-3000:]
    finally:
        for p in (full, crash):
            try:
                os.killpg(p.pid, signal.SIGKILL)  # any leftover worker of the killed job
            except ProcessLookupError:
                pass
    a, b = trained_steps(tmp_path / "a" / "metrics.jsonl"), trained_steps(metrics_b)
    assert sorted(a) == sorted(b) == list(range(1, 7))
    for step in a:
        assert b[step]["task_ids"] == a[step]["task_ids"], step
        assert b[step]["loss"] == a[step]["loss"], (step, kill_at)
        assert b[step]["reward_mean"] == a[step]["reward_mean"]
    trained = [t for s in sorted(b) for t in b[s]["task_ids"]]
    assert len(trained) == len(set(trained))


def test_a_corrupt_latest_checkpoint_is_passed_over(tmp_path: Path) -> None:
    """The job resumes from the newest *valid* checkpoint: with the latest one truncated (a crash
    mid-write on a store without atomic renames, or bit rot), it goes back to the previous one,
    says so in the log and the report, and still trains every step once."""
    save_random_init(tmp_path / "init", TINY)
    first = start(tmp_path, "c", [], {})
    assert first.wait(timeout=240) == 0, (tmp_path / "c.err").read_text()[-3000:]
    ckpt = tmp_path / "c" / "store" / "ckpt"
    steps = sorted(int(p.name.split("_")[1]) for p in ckpt.iterdir())
    assert steps[-2:] == [5, 6]  # checkpoint_every=1, keep_checkpoints=2
    victim = max((p for p in (ckpt / "step_00000006").iterdir() if p.name != "manifest.json"),
                 key=lambda p: p.stat().st_size)  # fmt: skip
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    again = start(tmp_path, "c", ["trainer.steps=8"], {})
    assert again.wait(timeout=240) == 0, (tmp_path / "c.err").read_text()[-3000:]
    err = (tmp_path / "c.err").read_text()
    assert "checkpoint step 6 is invalid" in err and "resuming from step 5" in err, err[-3000:]
    report = (tmp_path / "c" / "report.md").read_text()
    assert "**resumed from step**: 5" in report and "checkpoint step 6 is invalid" in report
    assert sorted(trained_steps(tmp_path / "c" / "metrics.jsonl")) == list(range(1, 9))
