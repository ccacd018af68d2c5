"""Rich tables for the planner's commands: one simulation, the validation table, the sweep."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

from slipstream.plan.rates import PlanConfig
from slipstream.plan.results import SimResult


def _pct(x: float) -> str:
    return f"{x * 100:.1f}%"


def print_result(console: Console, plan: PlanConfig, res: SimResult) -> None:
    from slipstream.plan.costs import cost_per_hour, describe_ep

    t = Table(title=f"plan simulate: {plan.name or 'rates'} ({res.steps} steps, "
              f"{res.num_events:,} events in {res.wall_s:.2f} s)")  # fmt: skip
    t.add_column("figure")
    t.add_column("value", justify="right")
    cost = cost_per_hour(plan)
    eng = plan.rollout.engine

    def tok_per_s(rows: int) -> float:  # decode tokens/s of one instance at `rows` running rows
        step = eng.slowdown * (eng.step_fixed_s + eng.step_per_token_s * rows)
        return rows * eng.throughput_scale / step if step > 0 else float("inf")

    quarter = max(1, eng.max_batch_rows // 4)
    rows = [
        (f"engine tokens/s per instance ({quarter} / {eng.max_batch_rows} rows)",
         f"{tok_per_s(quarter):,.0f} / {tok_per_s(eng.max_batch_rows):,.0f}"),
        ("samples/s (steady state)", f"{res.samples_per_s:,.2f}"),
        ("trainer idle fraction", _pct(res.trainer_idle_frac)),
        ("staleness histogram (groups)", " ".join(f"{k}:{v}" for k, v in
                                                  res.staleness_hist.items())),
        ("staleness bound / violations", f"{res.staleness_bound} / {res.staleness_violations}"),
        ("wasted samples (stale, nacked, lost)", f"{res.wasted_samples:,}"),
        ("wasted tokens (aborted generations)", f"{res.wasted_tokens:,}"),
        ("Spot interruptions / nacked / abandoned", f"{res.interruptions} / "
         f"{res.nacked_tasks} / {res.abandoned_tasks}"),
        ("mean request latency (engine)", f"{res.mean_request_latency_s:.3f} s"),
        ("mean trainer step", f"{res.mean_train_s:.3f} s"),
        ("rollout engines busy / instances up", f"{_pct(res.rollout_busy_frac)} / "
         f"{_pct(res.instance_up_frac)}"),
        ("cost", f"${cost:,.2f}/h"),
        ("cost per 1k trained samples", "-" if not cost else
         f"${cost / (res.samples_per_s * 3.6):,.4f}"),
    ]  # fmt: skip
    for k, v in rows:
        t.add_row(k, v)
    console.print(t)
    ep = describe_ep(plan)
    if ep:
        console.print(ep)


def print_validation(console: Console, record: dict[str, Any]) -> None:
    t = Table(title="plan validate: predicted vs measured (steady state, steps after warm-up)")
    for col in ("case", "load avg", "samples/s meas", "pred", "err", "idle meas", "pred", "ok"):
        t.add_column(col, justify="left" if col == "case" else "right")
    for c in record["cases"]:
        m, p = c["measured"], c["predicted"]
        ok = "yes" if c["samples_per_s_ok"] and c["trainer_idle_frac_ok"] else "NO"
        t.add_row(
            c["name"], f"{c['loadavg_before'][0]:.1f}-{c['loadavg_after'][0]:.1f}",
            f"{m['samples_per_s']:.1f}", f"{p['samples_per_s']:.1f}",
            f"{c['samples_per_s_error'] * 100:+.1f}%", _pct(m["trainer_idle_frac"]),
            _pct(p["trainer_idle_frac"]), ok,
        )  # fmt: skip
    console.print(t)
    console.print(f"{record['num_within']} of {record['num_cases']} cases within tolerance "
                  f"(samples/s relative {record['limit']['value']:.0%}; idle: "
                  f"{record['idle_rule']})")  # fmt: skip


def print_sweep(console: Console, plan: PlanConfig, res: Any) -> None:
    from slipstream.plan.costs import describe_ep

    frontier = {p.label for p in res.frontier}
    t = Table(title=f"plan search: {plan.name or 'rates'} ({len(res.points)} points, "
              f"{res.wall_s:.1f} s; * = on the frontier)")  # fmt: skip
    for col in ("point", "train:rollout nodes", "samples/s", "trainer idle", "engines busy",
                "wasted", "$/h", "$/1k samples"):  # fmt: skip
        t.add_column(col, justify="left" if col == "point" else "right")
    for p in res.points:
        mark = "*" if p.label in frontier else " "
        style = "bold green" if p is res.best else None
        t.add_row(f"{mark} {p.label}", f"{p.train_nodes}:{p.rollout_nodes}",
                  f"{p.samples_per_s:,.2f}", _pct(p.result.trainer_idle_frac),
                  _pct(p.result.rollout_busy_frac), f"{p.result.wasted_samples:,}",
                  f"{p.cost_per_hour:,.0f}", f"{p.cost_per_1k:,.3f}", style=style)  # fmt: skip
    console.print(t)
    if len(res.variants) > 1:
        v = Table(title="what-if variants at the configured split")
        for col in ("variant", "samples/s", "vs configured", "trainer idle", "mean step s",
                    "$/1k samples"):  # fmt: skip
            v.add_column(col, justify="left" if col == "variant" else "right")
        base = res.variants[0].samples_per_s
        for p in res.variants:
            v.add_row(p.label, f"{p.samples_per_s:,.2f}", f"{p.samples_per_s / base - 1:+.1%}",
                      _pct(p.result.trainer_idle_frac), f"{p.result.mean_train_s:,.1f}",
                      f"{p.cost_per_1k:,.3f}")  # fmt: skip
        console.print(v)
    ep = describe_ep(plan)
    if ep:
        console.print(ep)
    b = res.best
    console.print(f"[bold]recommended[/]: {b.label} ({b.train_nodes} trainer nodes, "
                  f"{b.rollout_instances} rollout instances = {b.rollout_nodes} nodes, density "
                  f"{b.density:g}, Spot {b.spot_fraction:.0%}): {b.samples_per_s:,.2f} samples/s, "
                  f"${b.cost_per_hour:,.0f}/h, ${b.cost_per_1k:,.3f} per 1k samples")  # fmt: skip
    console.print(f"reason: {res.reason}")
    console.print(f"plot: {res.plot_path}  data: {res.json_path}")
