"""Trainer kill-and-resume with real processes: the job (trainer + rollout worker processes) is
killed with SIGKILL at a random step and restarted; the resumed run continues from its last
checkpoint and, in deterministic mode, reproduces the uninterrupted run's per-step losses, task
ids and rewards exactly (so no task was lost or repeated)."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from slipstream.config import load_config
from slipstream.model import MoEForCausalLM, save_pretrained
from slipstream.tasks import get_taskset

TINY = [
    "model.hidden_size=32", "model.num_hidden_layers=1", "model.num_attention_heads=2",
    "model.num_key_value_heads=1", "model.head_dim=8", "model.intermediate_size=32",
    "model.moe_intermediate_size=16", "model.num_experts=4", "model.max_position_embeddings=64",
    "engine.max_seq_len=64", "engine.max_new_tokens=8", "eval.num_prompts=4", "run.num_threads=1",
    "task.num_heldout=4", "trainer.mode=sync", "trainer.deterministic=true", "trainer.steps=6",
    "trainer.checkpoint_every=1", "trainer.groups_per_step=2", "rollout.group_size=4",
    "rollout.num_workers=1", "trainer.lr=0.01", "rollout.lease_ttl_s=5",
    # a random tiny model earns no reward: step anyway, so every step has a loss to compare
    "trainer.skip_no_signal=false",
]  # fmt: skip


def per_step(metrics: Path) -> dict[int, dict]:
    out = {}
    for line in metrics.read_text().splitlines():
        rec = json.loads(line)
        if "loss" in rec:
            out[rec["step"]] = (
                rec  # a resumed run re-logs steps after its checkpoint: keep the last
            )
    return out


def start(tmp: Path, out: str, store: list[str], env: dict[str, str]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "slipstream.launch.local", "run", str(tmp / "empty.toml"),
           f"run.output_dir={tmp / out}", f"model.init_from={tmp / 'init'}", *TINY,
           *[o.replace("{out}", out) for o in store]]  # fmt: skip
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
    from slipstream.rl.checkpoint import CheckpointStore
    from slipstream.rl.weights import WeightStore

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
    (tmp_path / "empty.toml").write_text("")
    cfg = load_config(None, TINY)
    ts = get_taskset(cfg.task)
    torch.manual_seed(0)
    save_pretrained(
        MoEForCausalLM(cfg.model.model_copy(update={"vocab_size": ts.tokenizer.vocab_size})),
        tmp_path / "init",
    )

    full = start(tmp_path, "a", store, env)
    crash = start(tmp_path, "b", store, env)
    kill_at = random.Random().randint(2, 4)
    metrics_b = tmp_path / "b" / "metrics.jsonl"
    deadline = time.monotonic() + 180
    try:
        while not (metrics_b.exists() and max(per_step(metrics_b), default=0) >= kill_at):
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
    a, b = per_step(tmp_path / "a" / "metrics.jsonl"), per_step(metrics_b)
    assert sorted(a) == sorted(b) == list(range(1, 7))
    for step in a:
        assert b[step]["task_ids"] == a[step]["task_ids"], step
        assert b[step]["loss"] == a[step]["loss"], (step, kill_at)
        assert b[step]["reward_mean"] == a[step]["reward_mean"]
    trained = [t for s in sorted(b) for t in b[s]["task_ids"]]
    assert len(trained) == len(set(trained))
