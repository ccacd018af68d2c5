"""`slipstream bench rewards` end to end at a small size: the real engine, episode runner and
reward processes; the JSON carries every round of both ways and the figure is their median."""

from __future__ import annotations

import json
import statistics

from slipstream.cli import main


def test_bench_rewards_small(tmp_path) -> None:
    out = tmp_path / "rewards.json"
    argv = ["bench", "rewards", "--reward-s", "0.05", "--workers", "2", "--groups-per-step", "2",
            "--group-size", "2", "--inflight", "2", "--max-new-tokens", "8", "--steps", "1",
            "--rounds", "3", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    rec = json.loads(out.read_text())
    gen, both = rec["generation_s_per_step_rounds"], rec["both_s_per_step_rounds"]
    assert len(gen) == len(both) == 3 and min(gen + both) > 0
    assert rec["limit"]["value"] == statistics.median(gen)
    assert rec["figure"]["value"] == statistics.median(both)
    # 4 samples x 0.05 s over 2 processes: the reward alone takes at least 0.1 s per step
    assert rec["reward_alone_s_per_step"] >= 0.1
    assert rec["baseline"]["value"] == rec["limit"]["value"] + rec["reward_alone_s_per_step"]
    assert rec["statuses"] == ["done"]  # every group finished and was scored
    assert rec["provenance"]["cpu_model"]
