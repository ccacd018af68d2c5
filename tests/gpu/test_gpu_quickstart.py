"""A short quickstart on CUDA that learns: `slipstream run -c configs/quickstart.toml` with the
trainer and the rollout worker's engine on the GPU, the quickstart's SFT warm start (2400 steps,
its imperfect teacher) and 200 async GRPO steps instead of 2000. It must raise held-out greedy
pass@1 (500 prompts) by at least 5 points; on the CPU the same start gained +10 to +13 points
within 100-300 steps (docs/rl.md). Marked `slow`: scripts/gpu-check.sh runs it as its own
phase, after the quick GPU tests and the benchmark."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
RL_STEPS = 200
MIN_GAIN = 0.05
LIMIT_S = 225


def _events(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.timeout(LIMIT_S + 15)
def test_quickstart_on_cuda_learns(gpu, record, tmp_path: Path) -> None:
    out = tmp_path / "run"
    cmd = [
        sys.executable, "-c", "from slipstream.cli import main; raise SystemExit(main())",
        "run", "-c", str(ROOT / "configs" / "quickstart.toml"), "--plain",
        f"--run.output_dir={out}", f"--run.device={gpu.type}", f"--engine.device={gpu.type}",
        f"--trainer.steps={RL_STEPS}", "--trainer.eval_every=0", "--trainer.checkpoint_every=0",
    ]  # fmt: skip
    t0 = time.monotonic()
    with open(tmp_path / "run.log", "wb") as log:
        try:
            proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=LIMIT_S)
            rc: int | str = proc.returncode
        except subprocess.TimeoutExpired:
            rc = f"timeout after {LIMIT_S} s"
    wall_s = time.monotonic() - t0
    sft = [e for e in _events(out / "sft" / "metrics.jsonl") if "loss" in e]
    rl = _events(out / "metrics.jsonl")
    end = next((e for e in rl if e.get("event") == "end"), None)
    steps = [e for e in rl if "loss" in e]
    tail = (tmp_path / "run.log").read_text(errors="replace")[-3000:]
    last_sft = sft[-1] if sft else {}
    record(rc=rc, wall_s=wall_s, sft_steps=last_sft.get("step", 0),
           sft_last_loss=last_sft.get("loss"), sft_wall_s=last_sft.get("elapsed_s"),
           rl_steps=len(steps), pass_at_1_before=end and end.get("pass_at_1_before"),
           pass_at_1_after=end and end.get("pass_at_1"), rl_wall_s=end and end.get("wall_s"),
           final_reward=steps[-1].get("reward_mean") if steps else None)  # fmt: skip
    assert rc == 0, f"slipstream run: {rc}\n{tail}"
    assert end is not None, f"no end event in {out / 'metrics.jsonl'}\n{tail}"
    before, after = end["pass_at_1_before"], end["pass_at_1"]
    assert after >= before + MIN_GAIN, f"held-out pass@1 {before:.3f} -> {after:.3f}"
