#!/usr/bin/env python3
"""Summarise quickstart runs (`slipstream run` output dirs) as one Markdown table row each.

    python3 scripts/quickstart-summary.py RUN_DIR [RUN_DIR ...] [--runs runs.tsv]
    python3 scripts/quickstart-summary.py --curve --target 0.75 KNOBS_DIR/runs/*-seed*/

Per run: the SFT's wall time (its last `elapsed_s`), held-out pass@1 after SFT and after RL,
the gain, the RL loop's wall time and samples/s, and the first in-run evaluation that passed
issue 16's +16.8 points (its step and seconds into the RL loop). With `--runs` (the runs.tsv
that scripts/bench-readme.sh writes) the whole command's wall time is added, matched on the
run directory's name. Reads only the files a run writes (metrics.jsonl, sft/metrics.jsonl);
stdlib only, so it runs without the project's venv; a gzipped metrics.jsonl.gz is read too.

With `--curve` (runs of scripts/rl-knobs.sh, named SETTING-seedS): one row per setting, with
each seed's held-out pass@1 after RL, the seconds of RL loop until the first evaluation at or
above `--target` (the loop's wall clock without the in-run evaluations' own time, `eval_s`;
the time a run without evaluations would have taken to get there), and pass@1 at the
evaluations nearest 60 and 120 such seconds.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from pathlib import Path

PEER_GAIN_POINTS = 16.8  # issue 16: TRL GRPOTrainer's gain in its 330-s run


def read_jsonl(path: Path) -> list[dict]:
    """A metrics.jsonl, or its gzipped copy (metrics.jsonl.gz, as kept in benchmarks/results/)."""
    gz = path.with_suffix(".jsonl.gz")
    with gzip.open(gz, "rt") if not path.exists() and gz.exists() else path.open() as f:
        return [json.loads(line) for line in f if line.strip()]


def summarise(run_dir: Path, wall_by_name: dict[str, float]) -> dict:
    rl_rows = read_jsonl(run_dir / "metrics.jsonl")
    end = next(r for r in reversed(rl_rows) if r.get("event"))
    sft_rows = read_jsonl(run_dir / "sft" / "metrics.jsonl")
    before, after = end["pass_at_1_before"], end["pass_at_1"]
    reached = next(
        (
            r
            for r in rl_rows
            if r.get("evaluated") and (r["pass_at_1"] - before) * 100 >= PEER_GAIN_POINTS
        ),
        None,
    )
    samples = sum(r.get("num_samples", 0) for r in rl_rows)
    return {
        "run": run_dir.name,
        "sft_s": sft_rows[-1]["elapsed_s"],
        "before": before,
        "after": after,
        "gain_points": (after - before) * 100,
        "rl_s": end["wall_s"],
        "samples_per_s": samples / end["wall_s"],
        "reached_step": reached["step"] if reached else None,
        "reached_s": reached["elapsed_s"] if reached else None,
        "job_s": wall_by_name.get(run_dir.name),
    }


def curve(run_dir: Path) -> list[tuple[int, float, float]] | None:
    """(step, seconds of RL loop without evaluations, held-out pass@1) per evaluation, step 0
    first; None for a run without an end record (still running, or failed)."""
    try:
        rows = read_jsonl(run_dir / "metrics.jsonl")
    except FileNotFoundError:
        return None
    end = next((r for r in reversed(rows) if r.get("event") == "end"), None)
    if end is None:
        return None
    points = [(0, 0.0, end["pass_at_1_before"])]
    eval_total_s = 0.0
    for r in rows:
        if "elapsed_s" in r and r.get("evaluated"):
            eval_total_s += r.get("eval_s", 0.0)
            points.append((r["step"], r["elapsed_s"] - eval_total_s, r["pass_at_1"]))
    return points


def at_time(points: list[tuple[int, float, float]], t_s: float) -> float:
    """pass@1 of the last evaluation at or before t_s seconds (the curve is a step function)."""
    return max((p for p in points if p[1] <= t_s), key=lambda p: p[1])[2]


def print_curves(run_dirs: list[Path], target: float) -> None:
    """One row per setting. With runs of `slipstream bench peer` among them (named
    peer-seedS), each seed's own target is also the peer's final pass@1 on that seed: the
    seconds to reach it and that time as a multiple of the peer's whole RL time."""
    by_setting: dict[str, dict[str, list]] = {}
    for d in sorted(run_dirs):
        points = curve(d)
        if points is None:
            print(f"skipped {d}: no end record (running, or failed)", file=sys.stderr)
            continue
        setting, _, seed = d.name.rpartition("-seed")
        by_setting.setdefault(setting, {})[seed] = points
    peer = by_setting.get("peer", {})
    head = f"| setting | seeds | start | after RL | s to {target:.1%} | at 60 s | at 120 s | RL s |"
    if peer:
        head += " s to the peer's final (x peer's RL s) |"
    print(head)
    print("|" + "---|" * head.count(" |"))
    for setting, runs in by_setting.items():
        def col(f, runs=runs) -> str:
            return " / ".join(f(seed, c) for seed, c in runs.items())

        def reach(c, goal: float) -> float | None:
            return next((p[1] for p in c if p[2] >= goal), None)

        def reach_target(seed, c) -> str:
            t = reach(c, target)
            return "-" if t is None else f"{t:.0f}"

        def reach_peer(seed, c) -> str:
            if seed not in peer:
                return "-"
            t = reach(c, peer[seed][-1][2])
            return "not reached" if t is None else f"{t:.0f} ({t / peer[seed][-1][1]:.2f}x)"

        row = (
            f"| {setting} | {','.join(runs)} | {col(lambda s, c: f'{c[0][2]:.1%}')} | "
            f"{col(lambda s, c: f'{c[-1][2]:.1%}')} | {col(reach_target)} | "
            f"{col(lambda s, c: f'{at_time(c, 60):.1%}')} | "
            f"{col(lambda s, c: f'{at_time(c, 120):.1%}')} | {col(lambda s, c: f'{c[-1][1]:.0f}')} |"
        )
        print(row + (f" {col(reach_peer)} |" if peer else ""))


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("runs_dirs", nargs="+", type=Path, help="quickstart output dirs")
    p.add_argument("--runs", type=Path, default=None, help="runs.tsv from scripts/bench-readme.sh")
    p.add_argument("--curve", action="store_true", help="time-to-accuracy per setting (rl-knobs.sh)")
    p.add_argument("--target", type=float, default=0.75, help="held-out pass@1 to reach (--curve)")
    args = p.parse_args()
    if args.curve:
        print_curves(args.runs_dirs, args.target)
        return
    wall_by_name: dict[str, float] = {}
    if args.runs:
        for line in args.runs.read_text().splitlines()[1:]:
            name, _, _, wall_s, *_ = line.split("\t")
            wall_by_name[name] = float(wall_s)
    print(
        "| run | SFT s | after SFT | after RL | gain | +16.8 at (step, s into RL) | RL s | samples/s | job s |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for d in args.runs_dirs:
        s = summarise(d, wall_by_name)
        reached = (
            f"{s['reached_step']}, {s['reached_s']:.1f} s" if s["reached_step"] else "not reached"
        )
        job = f"{s['job_s']:.0f}" if s["job_s"] is not None else "-"
        print(
            f"| {s['run']} | {s['sft_s']:.0f} | {s['before']:.1%} | {s['after']:.1%} | "
            f"{s['gain_points']:+.1f} | {reached} | {s['rl_s']:.0f} | {s['samples_per_s']:.0f} | {job} |"
        )


if __name__ == "__main__":
    main()
