"""`slipstream plan simulate|search|calibrate|validate`: the capacity planner (docs/plan.md).

Imports nothing that imports torch: planning runs on a laptop without the training stack.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import Any

from slipstream.config.args import add_config_args

DESCRIPTION = """\
Simulate slipstream's asynchronous RL loop (trainer, coordinator with the real staleness bound and
admission rule, rollout instances with continuous batching, verification, Spot interruptions) from
a rates file, to choose a trainer:rollout split before renting the cluster."""

EPILOG = """\
examples:
  slipstream plan simulate -c configs/plan/p5en-48.toml
  slipstream plan simulate -c configs/plan/p5en-48.toml --trainer.num_nodes=20 --rollout.num_instances=14
  slipstream plan search -c configs/plan/p5en-48.toml --budget-per-hour 3000
  slipstream plan calibrate runs/quickstart -o runs/quickstart/rates.toml   # -c: the job's config
  slipstream plan validate          # real runs here vs predictions -> benchmarks/results/plan-validation.json"""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="capacity planner: simulate the RL loop from measured rates",
                       description=DESCRIPTION, epilog=EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    psub = p.add_subparsers(dest="plan_command", metavar="ACTION", required=True)

    s = psub.add_parser("simulate", help="simulate one configuration of a rates file")
    add_config_args(s, quickstart_default=False)
    s.add_argument("--json", action="store_true", help="print the result as JSON")
    s.set_defaults(func=cmd_simulate)

    w = psub.add_parser("search", help="search trainer:rollout splits; frontier, plot, advice")
    add_config_args(w, quickstart_default=False)
    w.add_argument("--budget-per-hour", type=float, default=None, help="$/h cap (overrides file)")
    w.add_argument("--target-samples-per-s", type=float, default=None,
                   help="throughput to reach at least cost (overrides file)")  # fmt: skip
    w.add_argument(
        "--out",
        default=None,
        help="directory for frontier.png / frontier.json (default runs/plan-NAME)",
    )
    w.set_defaults(func=cmd_search)

    c = psub.add_parser("calibrate", help="write a rates file from a finished run's measurements")
    c.add_argument("run_dir", metavar="RUN_DIR", help="the run's output_dir (metrics.jsonl, ...)")
    add_config_args(c)
    c.add_argument("-o", "--out", default=None, help="rates TOML (default RUN_DIR/plan-rates.toml)")
    c.add_argument(
        "--engine-bench",
        default="benchmarks/results/engine-quiet.json",
        help="`slipstream bench engine` JSON with the run's model (engine curve)",
    )
    c.add_argument(
        "--weights-bench",
        default=None,
        help="`slipstream bench weights` JSON: plan this store run's job with weights pushed "
        "(engine.weight_sync = distributed) at the bench's measured push times",
    )
    c.add_argument("--warmup-steps", type=int, default=2, help="steps excluded from figures")
    c.add_argument("--no-fit", action="store_true", help="keep slowdown 1 (no latency fit)")
    c.set_defaults(func=cmd_calibrate)

    v = psub.add_parser("validate", help="real runs here vs the planner's predictions (table)")
    add_config_args(v)
    v.add_argument(
        "--init",
        default=None,
        help="start checkpoint (default: a short SFT warm start made once under --dir)",
    )
    v.add_argument("--sft-steps", type=int, default=800, help="SFT steps of that warm start")
    v.add_argument("--cases", default="all", help="comma list of case names (default all)")
    v.add_argument("--dir", default="runs/plan-validation", help="where the runs go")
    v.add_argument("--engine-bench", default="benchmarks/results/engine-quiet.json")
    v.add_argument("--sim-seeds", type=int, default=5, help="simulations averaged per case")
    v.add_argument("--keep-runs", action="store_true", help="keep the runs' checkpoints")
    v.add_argument(
        "--reuse",
        action="store_true",
        help="re-predict from finished runs under --dir instead of running them again",
    )
    v.add_argument(
        "--code-ref",
        default=None,
        metavar="REF",
        help="run the jobs from `git archive REF` (e.g. HEAD) instead of the working tree, so "
        "concurrent edits cannot break or change them",
    )
    v.add_argument("--out", default="benchmarks/results/plan-validation.json")
    v.set_defaults(func=cmd_validate)


def _console() -> Any:
    import sys

    from rich.console import Console

    # piped output (logs, CI) gets a width the sweep table fits in, not rich's 80 columns
    return Console() if sys.stdout.isatty() else Console(width=140)


def cmd_simulate(args: argparse.Namespace) -> int:
    from slipstream.plan import load_rates, simulate
    from slipstream.plan.report import print_result

    plan = load_rates(args.config, args.overrides)
    res = simulate(plan)
    if args.json:
        print(json.dumps(res.to_dict(), indent=1))
        return 0
    print_result(_console(), plan, res)
    return 0


def cmd_search(args: argparse.Namespace) -> int:
    from slipstream.plan import load_rates
    from slipstream.plan.report import print_sweep
    from slipstream.plan.search import run_sweep

    # the flags are config overrides, so the rates file's bounds (finite, >= 0) check them too
    overrides = list(args.overrides)
    if args.budget_per_hour is not None:
        overrides.append(f"sweep.budget_per_hour={args.budget_per_hour!r}")
    if args.target_samples_per_s is not None:
        overrides.append(f"sweep.target_samples_per_s={args.target_samples_per_s!r}")
    plan = load_rates(args.config, overrides)
    name = plan.name or (Path(args.config).stem if args.config else "plan")
    # generated output goes under runs/ (not tracked): the default once overwrote the committed
    # benchmarks/plan-p5en-48/frontier.json; pass --out to publish a frontier there on purpose
    out = Path(args.out or f"runs/plan-{name}")
    result = run_sweep(plan, out)
    print_sweep(_console(), plan, result)
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    from slipstream.config import load_config
    from slipstream.plan import dump_toml
    from slipstream.plan.calibrate import calibrate

    job = load_config(args.config, args.overrides)
    plan = calibrate(args.run_dir, job, engine_bench=args.engine_bench,
                     warmup_steps=args.warmup_steps, fit=not args.no_fit,
                     weights_bench=args.weights_bench)  # fmt: skip
    out = Path(args.out or Path(args.run_dir) / "plan-rates.toml")
    header = (f"slipstream plan calibrate {args.run_dir} (job config {args.config}"
              + (" + " + " ".join(args.overrides) if args.overrides else "") + ")")  # fmt: skip
    out.write_text(dump_toml(plan, header=header))
    for note in plan.calibration.notes:
        print(f"  {note}")
    print(f"wrote {out}  (next: slipstream plan simulate -c {out})")
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    from slipstream.plan.report import print_validation
    from slipstream.plan.validate import run_validation

    logging.basicConfig(level=logging.WARNING)
    record = run_validation(
        config=args.config, overrides=args.overrides, init=args.init, sft_steps=args.sft_steps,
        case_names=None if args.cases == "all" else args.cases.split(","),
        out_dir=Path(args.dir), engine_bench=args.engine_bench, seeds=args.sim_seeds,
        keep_runs=args.keep_runs, out_json=Path(args.out), reuse=args.reuse,
        code_ref=args.code_ref,
        on_case=lambda r: print(f"{r.case.name}: measured {r.measured['samples_per_s']:.1f} "
                                f"samples/s, predicted {r.predicted['samples_per_s']:.1f} "
                                f"({r.wall_s:.0f} s)", flush=True),
    )  # fmt: skip
    print_validation(_console(), record)
    print(f"wrote {args.out}")
    return 0
