"""The agentic quickstart's job end to end, shrunk: `slipstream run -c configs/agentic.toml`
(SFT on tool-using demonstrations, async GRPO through python_tool episodes in bwrap sandboxes,
held-out evaluation through the same episode loop) exits 0, its report shows tool calls per
episode, sandbox acquire p50/p99 and infrastructure failures, and no sandbox is left."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from sandboxutil import needs_bwrap
from slipstream.observe.metrics import read_metrics
from slipstream.sandbox.journal import Journal

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@needs_bwrap
def test_agentic_job_runs_and_reports_episode_figures(tmp_path: Path) -> None:
    state = tmp_path / "sandbox-state"
    args = [
        str(Path(sys.executable).parent / "slipstream"), "run", "--plain",
        "-c", str(ROOT / "configs/agentic.toml"),
        f"--run.output_dir={tmp_path}/run", "--sft.steps=30", "--trainer.steps=3",
        "--trainer.eval_every=0", "--eval.num_prompts=8", "--task.num_heldout=8",
        "--rollout.max_inflight_tasks=2", "--sandbox.min_idle=2", "--sandbox.max_idle=16",
        f"--sandbox.state_dir={state}",
    ]  # fmt: skip
    proc = subprocess.run(args, cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = (tmp_path / "run" / "report.md").read_text()
    line = next(ln for ln in report.splitlines() if ln.startswith("- **buffer**"))
    buffer = ast.literal_eval(line.split(": ", 1)[1])
    for key in ("tool_calls_per_episode", "sandbox_acquire_p50_s", "sandbox_acquire_p99_s",
                "infra_failures", "infra_retried_episodes", "dropped_infra"):  # fmt: skip
        assert key in buffer, key
    assert buffer["episodes"] >= 3 * 8 * 8 and buffer["sandbox_acquire_p50_s"] is not None
    assert buffer["infra_failures"] == 0 and buffer["dropped_infra"] == 0
    assert Journal(state).entries() == []  # the worker's and the evaluations' pools are gone
    steps = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "reward_mean" in r]
    assert len(steps) == 3 and all(r["tool_calls_per_sample"] >= 0 for r in steps)
