"""`slipstream plan search`: search trainer:rollout splits, then sandbox density and Spot share at
the best split; the frontier, a plot and a recommendation with its reason.

Search (coordinate-wise, so a sweep is a few dozen simulations):
1. every split in `sweep.train_nodes` (default: every trainer node count that leaves whole
   rollout instances) of `sweep.total_nodes` GPU nodes, at the configured density and Spot share;
2. at the best split: each of `sweep.densities` (shared sandbox pool: the verifier latency Dist
   of kind `sweep` is read at that density and the pool has nodes x vCPUs x density sandboxes),
   then each of `sweep.spot_fractions` at the best density;
3. each named `sweep.variants` (dotted overrides, e.g. no DeepEP) at the configured split.

Best = highest samples/s within `budget_per_hour`; else cheapest reaching `target_samples_per_s`;
else lowest cost per 1k trained samples. The frontier is the Pareto set over (samples/s up,
$/h down) of every simulated point. Writes frontier.png and frontier.json under the output
directory. Not covered: joint search over all dimensions at once, uncertainty bands (one seed per
point; the seed is fixed, so points differ by configuration, not by noise).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slipstream.plan.costs import cost_per_1k_samples, cost_per_hour
from slipstream.plan.rates import PlanConfig, with_overrides
from slipstream.plan.results import SimResult
from slipstream.plan.sim import Simulator


@dataclass
class Point:
    label: str
    stage: str  # "split", "density", "spot", "variant"
    train_nodes: int
    rollout_instances: int
    rollout_nodes: int
    density: float
    spot_fraction: float
    cost_per_hour: float
    result: SimResult

    @property
    def samples_per_s(self) -> float:
        return self.result.samples_per_s

    @property
    def cost_per_1k(self) -> float:
        return self.cost_per_hour / (self.samples_per_s * 3.6) if self.samples_per_s else 1e30

    def to_dict(self) -> dict[str, Any]:
        r = self.result
        return {
            "label": self.label, "stage": self.stage, "train_nodes": self.train_nodes,
            "rollout_instances": self.rollout_instances, "rollout_nodes": self.rollout_nodes,
            "density": self.density, "spot_fraction": self.spot_fraction,
            "cost_per_hour": self.cost_per_hour, "cost_per_1k_samples": self.cost_per_1k,
            "samples_per_s": r.samples_per_s, "trainer_idle_frac": r.trainer_idle_frac,
            "rollout_busy_frac": r.rollout_busy_frac, "wasted_samples": r.wasted_samples,
            "interruptions": r.interruptions, "staleness_hist": r.to_dict()["staleness_hist"],
            "mean_train_s": r.mean_train_s, "mean_request_latency_s": r.mean_request_latency_s,
        }  # fmt: skip


@dataclass
class SweepResult:
    points: list[Point]
    frontier: list[Point]
    best: Point
    reason: str
    configured: Point
    plot_path: Path
    json_path: Path
    wall_s: float
    variants: list[Point] = field(default_factory=list)


def total_nodes(plan: PlanConfig) -> int:
    ro = plan.rollout
    return (
        plan.sweep.total_nodes or plan.trainer.num_nodes + ro.num_instances * ro.nodes_per_instance
    )


def split_counts(plan: PlanConfig) -> list[int]:
    if plan.sweep.train_nodes:
        return sorted(set(plan.sweep.train_nodes))
    total, per = total_nodes(plan), plan.rollout.nodes_per_instance
    return [n for n in range(1, total) if (total - n) % per == 0 and (total - n) // per >= 1]


def at_split(plan: PlanConfig, train_nodes: int) -> PlanConfig:
    total, per = total_nodes(plan), plan.rollout.nodes_per_instance
    instances = (total - train_nodes) // per
    if instances < 1:
        raise ValueError(f"{train_nodes} trainer nodes of {total} leave no rollout instance")
    p = plan.model_copy(deep=True)
    p.trainer.num_nodes = train_nodes
    p.rollout.num_instances = instances
    if plan.sweep.steps:
        p.loop.steps = max(plan.sweep.steps, p.loop.warmup_steps + 1)
    return p


def at_density(plan: PlanConfig, density: float) -> PlanConfig:
    p = plan.model_copy(deep=True)
    p.verifier.density = density
    if p.verifier.latency_s.kind == "sweep":
        p.verifier.latency_s.density = density
    return p


def evaluate(plan: PlanConfig, label: str, stage: str) -> Point:
    res = Simulator(plan).run()
    ro = plan.rollout
    return Point(label, stage, plan.trainer.num_nodes, ro.num_instances,
                 ro.num_instances * ro.nodes_per_instance, plan.verifier.density,
                 ro.spot_fraction, cost_per_hour(plan), res)  # fmt: skip


def choose(points: list[Point], plan: PlanConfig) -> tuple[Point, str]:
    sw = plan.sweep
    if sw.budget_per_hour:
        ok = [p for p in points if p.cost_per_hour <= sw.budget_per_hour + 1e-9]
        if ok:
            best = max(ok, key=lambda p: (p.samples_per_s, -p.cost_per_hour))
            return best, f"highest samples/s within the budget of ${sw.budget_per_hour:,.0f}/h"
        cheapest = min(points, key=lambda p: p.cost_per_hour)
        return cheapest, (f"nothing fits the budget of ${sw.budget_per_hour:,.0f}/h; the "
                          f"cheapest point costs ${cheapest.cost_per_hour:,.0f}/h")  # fmt: skip
    if sw.target_samples_per_s:
        ok = [p for p in points if p.samples_per_s >= sw.target_samples_per_s]
        if ok:
            best = min(ok, key=lambda p: (p.cost_per_hour, -p.samples_per_s))
            return best, f"cheapest point reaching {sw.target_samples_per_s:,.1f} samples/s"
        fastest = max(points, key=lambda p: p.samples_per_s)
        return fastest, (f"no point reaches {sw.target_samples_per_s:,.1f} samples/s; the "
                         f"fastest reaches {fastest.samples_per_s:,.1f}")  # fmt: skip
    best = min(points, key=lambda p: p.cost_per_1k)
    return best, "lowest cost per 1k trained samples"


def bottleneck(p: Point) -> str:
    r = p.result
    if r.trainer_idle_frac > 0.15:
        return (f"rollout-bound: the trainer waits {r.trainer_idle_frac:.0%} of the time "
                f"(engines busy {r.rollout_busy_frac:.0%})")  # fmt: skip
    return (f"trainer-bound: the trainer waits only {r.trainer_idle_frac:.0%} while engines are "
            f"busy {r.rollout_busy_frac:.0%}")  # fmt: skip


def pareto(points: list[Point]) -> list[Point]:
    """Points no other point beats on both samples/s (higher) and $/h (lower)."""
    front = []
    for p in points:
        dominated = any(
            q.samples_per_s >= p.samples_per_s and q.cost_per_hour <= p.cost_per_hour
            and (q.samples_per_s > p.samples_per_s or q.cost_per_hour < p.cost_per_hour)
            for q in points
        )  # fmt: skip
        if not dominated:
            front.append(p)
    return sorted(front, key=lambda p: p.cost_per_hour)


def run_sweep(plan: PlanConfig, out_dir: Path) -> SweepResult:
    t0 = time.perf_counter()
    sw = plan.sweep
    splits = [evaluate(at_split(plan, n), f"{n}:{total_nodes(plan) - n}", "split")
              for n in split_counts(plan)]  # fmt: skip
    best, _ = choose(splits, plan)
    points = list(splits)
    base = at_split(plan, best.train_nodes)
    if sw.densities and plan.verifier.pool == "shared":
        dens = [evaluate(at_density(base, d), f"{best.label} density {d:g}", "density")
                for d in sw.densities]  # fmt: skip
        points += dens
        best_d, _ = choose([best, *dens], plan)
        base = at_density(base, best_d.density)
    if sw.spot_fractions:
        for f in sw.spot_fractions:
            p = base.model_copy(deep=True)
            p.rollout.spot_fraction = f
            points.append(evaluate(p, f"{best.label} density {p.verifier.density:g} spot {f:g}",
                                   "spot"))  # fmt: skip
    configured_plan = plan.model_copy(deep=True)
    if sw.steps:
        configured_plan.loop.steps = max(sw.steps, plan.loop.warmup_steps + 1)
    configured = evaluate(configured_plan, "configured", "variant")
    variants = [configured]
    for name, overrides in sw.variants.items():
        variants.append(evaluate(with_overrides(configured_plan, overrides), name, "variant"))
    chosen, why = choose(points, plan)
    reason = f"{why}; {bottleneck(chosen)}"
    neighbours = sorted(splits, key=lambda p: p.train_nodes)
    idx = next((i for i, p in enumerate(neighbours) if p.train_nodes == chosen.train_nodes), None)
    if idx is not None and idx + 1 < len(neighbours):
        nxt = neighbours[idx + 1]
        gain = nxt.samples_per_s / chosen.samples_per_s - 1
        reason += (f"; moving to {nxt.label} changes samples/s by {gain:+.0%} and cost per 1k "
                   f"samples by {nxt.cost_per_1k / chosen.cost_per_1k - 1:+.0%}")  # fmt: skip
    out_dir.mkdir(parents=True, exist_ok=True)
    frontier = pareto(points)
    plot_path = plot_sweep(splits, chosen, plan, out_dir / "frontier.png")
    json_path = out_dir / "frontier.json"
    result = SweepResult(points, frontier, chosen, reason, configured, plot_path, json_path,
                         time.perf_counter() - t0, variants)  # fmt: skip
    json_path.write_text(json.dumps(sweep_record(plan, result), indent=1))
    return result


def _light_provenance() -> dict[str, Any]:
    """Where and from which code a sweep ran (no torch facts: this package must not import it)."""
    import datetime
    import platform
    import socket
    import subprocess

    repo = Path(__file__).resolve().parents[3]
    git = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True,
                         check=False)  # fmt: skip
    return {
        "hostname": socket.gethostname(), "python": platform.python_version(),
        "git_commit": git.stdout.strip() or None,
        "timestamp_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }  # fmt: skip


def sweep_record(plan: PlanConfig, res: SweepResult) -> dict[str, Any]:
    return {
        "provenance": _light_provenance(),
        "name": plan.name, "total_nodes": total_nodes(plan),
        "objective": {"budget_per_hour": plan.sweep.budget_per_hour,
                      "target_samples_per_s": plan.sweep.target_samples_per_s},
        "points": [p.to_dict() for p in res.points],
        "frontier": [p.label for p in res.frontier],
        "recommended": res.best.to_dict(), "reason": res.reason,
        "variants": [p.to_dict() for p in res.variants], "wall_s": res.wall_s,
    }  # fmt: skip


def plot_sweep(splits: list[Point], best: Point, plan: PlanConfig, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = sorted(splits, key=lambda p: p.train_nodes)
    x = [p.train_nodes for p in pts]
    fig, (ax1, ax3) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    ax1.plot(x, [p.samples_per_s for p in pts], "o-", color="tab:blue", label="samples/s")
    ax1.set_ylabel("trained samples/s", color="tab:blue")
    ax2 = ax1.twinx()
    ax2.plot(x, [p.result.trainer_idle_frac for p in pts], "s--", color="tab:red",
             label="trainer idle")  # fmt: skip
    ax2.set_ylabel("trainer idle fraction", color="tab:red")
    ax2.set_ylim(-0.02, 1.02)
    ax1.axvline(best.train_nodes, color="grey", lw=1, ls=":")
    ax1.set_title(f"{plan.name or 'plan'}: {total_nodes(plan)} nodes split trainer:rollout")
    ax1.grid(alpha=0.3)
    ax3.plot(x, [p.cost_per_1k for p in pts], "o-", color="tab:green")
    ax3.set_ylabel("$ per 1k trained samples", color="tab:green")
    ax4 = ax3.twinx()
    ax4.plot(x, [p.cost_per_hour for p in pts], ":", color="tab:olive")
    ax4.set_ylabel("$ per hour", color="tab:olive")
    ax3.axvline(best.train_nodes, color="grey", lw=1, ls=":")
    ax3.set_xlabel("trainer nodes (the rest roll out)")
    ax3.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


__all__ = ["Point", "SweepResult", "cost_per_1k_samples", "run_sweep"]
