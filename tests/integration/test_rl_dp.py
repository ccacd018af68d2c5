"""The job with a data-parallel trainer (`trainer.num_processes = 2`: rank 0 runs the loop, a
follower process trains its share of every batch): same batches and same weights as the
single-process job, within float reduction-order error, also when the 2-rank job stops and is
resumed from its checkpoint (the follower restores the same trainer state as rank 0)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch

from jobutil import TINY_MODEL, job_cmd, save_random_init, trained_steps
from slipstream.storage import WeightStore

TINY = [
    *TINY_MODEL, "trainer.mode=sync", "trainer.deterministic=true", "trainer.steps=3",
    "trainer.checkpoint_every=0", "trainer.groups_per_step=4", "rollout.group_size=4",
    "rollout.num_workers=1", "trainer.lr=0.01", "rollout.lease_ttl_s=5",
    # DP equals one process for equal shards under seq_mean, without the MoE load-balancing loss
    # (computed per rank's share, like Megatron's per-micro-batch balancing; trainer.py's contract)
    "trainer.aggregation=seq_mean", "model.router_aux_loss_coef=0.0",
    # a random tiny model earns no reward: the entropy bonus gives every step a real gradient
    "trainer.skip_no_signal=false", "trainer.entropy_coef=0.1",
]  # fmt: skip


def run_job(tmp: Path, out: str, *extra: str) -> list[dict]:
    """The job's per-step records, in step order."""
    proc = subprocess.run(job_cmd(tmp, tmp / out, [*TINY, *extra]), env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True,
                          timeout=240)  # fmt: skip
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    return sorted(trained_steps(tmp / out / "metrics.jsonl").values(), key=lambda r: r["step"])


@pytest.mark.slow
def test_two_trainer_ranks_train_like_one(tmp_path: Path) -> None:
    save_random_init(tmp_path / "init", TINY)
    one = run_job(tmp_path, "one")
    run_job(tmp_path, "two", "trainer.num_processes=2", "trainer.steps=2")
    resumed_log = tmp_path / "two" / "launch" / "logs" / "trainer-rank1.log"
    assert "done after 2 steps (version 2)" in resumed_log.read_text()
    two = run_job(tmp_path, "two", "trainer.num_processes=2")
    assert "resumed from checkpoint step 2" in resumed_log.read_text()
    assert [r["step"] for r in one] == [r["step"] for r in two] == [1, 2, 3]
    for a, b in zip(one, two, strict=True):
        assert a["task_ids"] == b["task_ids"]
        assert a["reward_mean"] == b["reward_mean"] and a["num_samples"] == b["num_samples"] == 16
        assert a["entropy"] == pytest.approx(b["entropy"], rel=1e-4)  # mean over both ranks
    w1 = WeightStore(str(tmp_path / "one" / "store")).fetch(3)
    w2 = WeightStore(str(tmp_path / "two" / "store")).fetch(3)
    w0 = WeightStore(str(tmp_path / "one" / "store")).fetch(2)
    moved = max((w1[k] - w0[k]).abs().max().item() for k in w1)
    assert moved > 1e-4  # the steps did train
    for k in w1:  # Adam divides by sqrt(v): reduction-order noise of ~1e-7 grows to ~2e-5 here
        torch.testing.assert_close(w2[k], w1[k], rtol=1e-4, atol=1e-4, msg=k)
    assert "done after 1 steps (version 3)" in resumed_log.read_text()
    report = (tmp_path / "two" / "report.md").read_text()
    assert "trainer rank exit codes**: [0]" in report
