"""`slipstream run -c configs/rlhf.toml`, shrunk: SFT, preference pairs from the verifier's
verdicts on sampled completions, the reward model, then RL against the reward model only, in one
command (real worker processes); the report names the reward source and the RM's held-out
accuracy, and every trained reward is the RM's (the batch reward is the reward-model component's
mean over every sample, which the verifier's component is not)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SHRINK = [
    "model.hidden_size=32", "model.num_hidden_layers=1", "model.num_attention_heads=2",
    "model.num_key_value_heads=1", "model.head_dim=16", "model.moe_intermediate_size=32",
    "model.num_experts=4", "task.max_digits=1", "task.num_heldout=16", "eval.num_prompts=16",
    "sft.steps=150", "sft.lr=3e-3", "sft.log_every=50", "rm.pair_prompts=120", "rm.pair_samples=8",
    "rm.steps=20", "rm.batch_size=16", "rm.log_every=10", "trainer.steps=4",
    "trainer.eval_every=2", "trainer.checkpoint_every=2", "trainer.groups_per_step=2",
]  # fmt: skip


def test_rlhf_config_runs_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "run"
    slipstream = str(Path(sys.executable).parent / "slipstream")
    cmd = [slipstream, "run", "--plain", "-c", str(ROOT / "configs" / "rlhf.toml"),
           f"--run.output_dir={out}", *(f"--{o}" for o in SHRINK)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "rm held-out pairwise accuracy" in proc.stdout
    pairs = (out / "rm" / "pairs.jsonl").read_text().splitlines()
    assert pairs and all({"prompt", "chosen", "rejected"} <= set(json.loads(p)) for p in pairs)
    summary = json.loads((out / "rm" / "checkpoint" / "rm_summary.json").read_text())
    report = (out / "report.md").read_text()
    assert "**reward source**: reward_model" in report
    assert f"**RM held-out pairwise accuracy**: {summary['heldout_accuracy']:.4g}" in report
    assert (out / "reward_curve.png").stat().st_size > 0
    steps = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in steps if "reward_mean" in r]
    assert len(trained) == 4
    for r in trained:
        # the source of every trained reward: the reward-model component scored every sample
        # and the batch's reward is exactly its mean; the verifier's verdict (also computed,
        # weight 0) is not in it
        assert r["reward/reward_model/none"] == 0.0 and r["reward/verifier/none"] == 0.0
        assert r["reward_mean"] == pytest.approx(r["reward/reward_model/mean"], abs=1e-9)
        assert 0 < r["reward/reward_model/mean"] < 1  # sigmoid(RM score)
    assert any(abs(r["reward_mean"] - r["reward/verifier/mean"]) > 1e-6 for r in trained)
