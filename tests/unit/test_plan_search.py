"""`plan search`: choice rules, Pareto frontier, and the command on the p5en-48 example (a reduced
search so the test stays short; the full one is `slipstream plan search -c
configs/plan/p5en-48.toml`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from slipstream.plan import PlanConfig, load_rates
from slipstream.plan.results import SimResult
from slipstream.plan.search import Point, choose, pareto, split_counts


def point(label: str, sps: float, cost: float, idle: float = 0.0) -> Point:
    res = SimResult(steps=2, warmup_steps=1, samples_per_s=sps, trainer_idle_frac=idle,
                    window_s=1, sim_time_s=1, staleness_hist={}, staleness_bound=0,
                    staleness_violations=0, wasted_samples=0, wasted_tokens=0,
                    dropped_stale_groups=0, rejected_acks=0, nacked_tasks=0, abandoned_tasks=0,
                    expired_leases=0, interruptions=0, mean_request_latency_s=0, num_requests=0,
                    mean_train_s=0, mean_in_flight=0, mean_in_flight_time_s=0,
                    completion_rate_per_s=0, rollout_busy_frac=0, instance_up_frac=1,
                    num_events=0, wall_s=0)  # fmt: skip
    return Point(label, "split", 1, 1, 1, 1.0, 0.0, cost, res)


POINTS = [point("a", 10, 100), point("b", 20, 150), point("c", 25, 300), point("d", 15, 200)]


def test_choice_rules() -> None:
    plan = PlanConfig()
    best, why = choose(POINTS, plan)  # lowest cost per 1k: b (150 / 20)
    assert best.label == "b" and "cost per 1k" in why
    plan.sweep.budget_per_hour = 250
    assert choose(POINTS, plan)[0].label == "b"
    plan.sweep.budget_per_hour = 50
    assert "nothing fits" in choose(POINTS, plan)[1]
    plan.sweep.budget_per_hour = 0
    plan.sweep.target_samples_per_s = 22
    assert choose(POINTS, plan)[0].label == "c"
    plan.sweep.target_samples_per_s = 99
    assert "no point reaches" in choose(POINTS, plan)[1]


def test_pareto_drops_dominated_points() -> None:
    assert [p.label for p in pareto(POINTS)] == ["a", "b", "c"]  # d: slower and dearer than b


def test_default_splits_leave_whole_instances() -> None:
    plan = load_rates("configs/plan/p5en-48.toml", ["sweep.train_nodes=[]"])
    counts = split_counts(plan)
    assert counts[0] == 2 and counts[-1] == 46
    assert all((48 - n) % 2 == 0 for n in counts)


def test_sweep_command_prints_frontier_and_writes_plot(tmp_path: Path) -> None:
    code = "import sys; from slipstream.cli import main; sys.exit(main())"
    args = ["plan", "search", "-c", "configs/plan/p5en-48.toml", "--out", str(tmp_path),
            "--sweep.train_nodes=[12,16,20]", "--sweep.densities=[0.5,1.0]",
            "--sweep.spot_fractions=[0.0]", "--sweep.steps=6", "--loop.warmup_steps=2",
            "--budget-per-hour", "2000"]  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                         check=False)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "recommended" in out.stdout and "reason" in out.stdout
    assert "no DeepEP (seed baseline)" in out.stdout  # the what-if variants
    assert (tmp_path / "frontier.png").stat().st_size > 10_000
    rec = json.loads((tmp_path / "frontier.json").read_text())
    assert rec["recommended"]["cost_per_hour"] <= 2000
    assert {p["stage"] for p in rec["points"]} == {"split", "density", "spot"}
    assert set(rec["frontier"]) <= {p["label"] for p in rec["points"]}
