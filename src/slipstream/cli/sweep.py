"""`slipstream sweep run|report|compare`: map tail latency against sandbox density (seed 002)."""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from pydantic import Field

from slipstream.cli import add_config_args
from slipstream.config.base import ConfigError, Section, load_model
from slipstream.config.sweep import SweepConfig

DESCRIPTION = """\
How many sandboxes per host before tail latency hurts the RL loop?

For every configuration (backend x CPU pinning x NUMA memory placement x SMT state as found) and
every density (sandboxes per vCPU), the sweep starts that many sandboxes, releases the workload in
all of them at once (a barrier), and records one latency per sandbox per iteration; failures are
kept as failed samples with their reason. Per cell it reports percentiles up to p99.9, the spread
across repeats, throughput, and the GRPO amplification E[max of G latencies] / p50: a gradient step
waits for the slowest rollout of its group of G. The recommendation is the highest density whose
amplification stays within --tolerance of the lowest density's, next to the seed's rule of thumb
(p99 flat up to 1.0 sandbox per vCPU, cliff within the next 15%)."""

RUN_EPILOG = """\
examples:
  slipstream sweep run --dry-run                     # plan + estimated duration, runs nothing
  slipstream sweep run                               # defaults: bwrap, pinning none/core, verify
  slipstream sweep run --backends process --densities 0.5,1,2 --repeats 1 --iterations 5
  slipstream sweep run --workload-cmd 'cd /tmp && git init -q x' --out my-sweep
  slipstream sweep run --dry-run --sysfs-root tests/data/sysfs_2numa_smt_4l3   # plan for another host
  slipstream sweep run -c sweep.toml --sweep.tolerance=0.2   # TOML has a [sweep] table

Options the host cannot honour (interleave on one NUMA node, a missing backend, SMT switching
without root) are listed in the plan and the report, never silently dropped. Read the p99/p50
column and the amplification table at your GRPO group size; the sweep is only as quiet as the
host: the noise check's CV is in the report."""


class SweepFile(Section):
    """A sweep TOML file: one `[sweep]` table."""

    sweep: SweepConfig = Field(default_factory=SweepConfig)
    """The sweep's settings."""


def _floats(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated numbers, got {text!r}"
        ) from None


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None


def _words(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


# flag dest -> SweepConfig field
FLAG_FIELDS = {
    "backends": "backends",
    "pinnings": "pinnings",
    "memory": "memory_placements",
    "smt": "smt",
    "densities": "densities",
    "repeats": "repeats",
    "iterations": "iterations",
    "min_samples": "min_samples_per_cell",
    "workload": "workload",
    "workload_cmd": "workload_cmd",
    "workload_scale": "workload_scale",
    "timeout_s": "timeout_s",
    "start_concurrency": "start_concurrency",
    "group_sizes": "group_sizes",
    "recommend_g": "recommend_g",
    "tolerance": "tolerance",
    "sysfs_root": "sysfs_root",
    "noise_runs": "noise_check_runs",
}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "sweep",
        help="density sweep: tail latency vs sandboxes per vCPU, and the operating point",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ssub = p.add_subparsers(dest="sweep_command", metavar="ACTION", required=True)

    run = ssub.add_parser(
        "run",
        help="plan and run a sweep (or --dry-run to print the plan)",
        description=DESCRIPTION,
        epilog=RUN_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_config_args(run, quickstart_default=False)
    d = SweepConfig()
    m = run.add_argument_group("matrix")
    m.add_argument(
        "--backends",
        type=_words,
        help=f"comma list of process,bwrap,qemu,firecracker (default {','.join(d.backends)})",
    )
    m.add_argument(
        "--pinnings",
        type=_words,
        help=f"comma list of none,core,thread,l3 (default {','.join(d.pinnings)})",
    )
    m.add_argument(
        "--memory",
        type=_words,
        help="comma list of local,interleave (interleave needs >= 2 NUMA nodes; default both)",
    )
    m.add_argument(
        "--smt",
        type=_words,
        help="comma list of as-found,on,off (default as-found: recorded, never switched)",
    )
    m.add_argument(
        "--densities",
        type=_floats,
        help=f"sandboxes per vCPU (default {','.join(f'{x:g}' for x in d.densities)})",
    )
    m.add_argument(
        "--repeats", type=int, help=f"fresh-sandbox repeats per cell (default {d.repeats})"
    )
    m.add_argument(
        "--iterations",
        type=int,
        help=f"minimum samples per sandbox per repeat (default {d.iterations})",
    )
    m.add_argument(
        "--min-samples",
        type=int,
        help=f"raise iterations at low density until a cell has this many samples (default "
        f"{d.min_samples_per_cell} = 10 x G=16; 0 = off)",
    )
    w = run.add_argument_group("workload")
    w.add_argument(
        "--workload",
        choices=["cpu-loop", "verify", "build", "io", "episode"],
        help=f"built-in workload (default {d.workload})",
    )
    w.add_argument(
        "--workload-cmd", metavar="SHELL", help="your own workload, run with sh -c in each sandbox"
    )
    w.add_argument("--workload-scale", type=float, help="size multiplier of the built-in workload")
    w.add_argument(
        "--timeout-s",
        type=float,
        help=f"per-sample timeout; a timeout is a failed sample (default {d.timeout_s:g})",
    )
    w.add_argument(
        "--start-concurrency",
        type=int,
        help=f"sandboxes created at once (default {d.start_concurrency})",
    )
    s = run.add_argument_group("statistics")
    s.add_argument("--group-sizes", type=_ints, help="GRPO group sizes G (default 8,16,64)")
    s.add_argument(
        "-G",
        "--recommend-g",
        type=int,
        help=f"G used for the recommendation (default {d.recommend_g})",
    )
    s.add_argument(
        "--tolerance",
        type=float,
        help=f"allowed amplification growth over the lowest density (default {d.tolerance:g})",
    )
    s.add_argument("--noise-runs", type=int, help="idle-host noise check runs (0 = skip)")
    o = run.add_argument_group("run")
    o.add_argument("--sysfs-root", help="read topology here instead of /sys (dry-run only)")
    o.add_argument(
        "--out", metavar="DIR", help="run directory (default benchmarks/sweeps/<UTC time>)"
    )
    o.add_argument(
        "--dry-run",
        action="store_true",
        help="print the plan and its estimated duration; run nothing",
    )
    o.add_argument("--json", action="store_true", help="with --dry-run: print the plan as JSON")
    o.add_argument("--no-progress", action="store_true", help="no progress bar")
    run.set_defaults(func=cmd_run)

    rep = ssub.add_parser(
        "report", help="rebuild aggregates.json, plots and report.md from samples.csv"
    )
    rep.add_argument("run_dir", metavar="DIR")
    rep.add_argument("--print", action="store_true", help="also print report.md")
    rep.set_defaults(func=cmd_report)

    cmp_ = ssub.add_parser(
        "compare", help="two runs side by side (p50, p99, amplification, failures)"
    )
    cmp_.add_argument("run_a", metavar="DIR_A")
    cmp_.add_argument("run_b", metavar="DIR_B")
    cmp_.set_defaults(func=cmd_compare)


def config_from_args(args: argparse.Namespace) -> SweepConfig:
    """TOML [sweep] table + dotted overrides + explicit flags (flags win)."""
    cfg = load_model(SweepFile, args.config, getattr(args, "overrides", None)).sweep
    data = cfg.model_dump()
    for dest, field in FLAG_FIELDS.items():
        value = getattr(args, dest, None)
        if value is not None:
            data[field] = value
    try:
        return SweepConfig.model_validate(data)
    except ValueError as e:
        raise ConfigError(f"invalid sweep options: {e}") from None


def cmd_run(args: argparse.Namespace) -> int:
    from slipstream.sweep.matrix import format_plan
    from slipstream.sweep.run import make_plan, run_sweep

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    cfg = config_from_args(args)
    if args.dry_run:
        plan = make_plan(cfg)
        if args.json:
            print(
                json.dumps(
                    {"config": cfg.model_dump(mode="json"), "plan": plan.to_dict()}, indent=1
                )
            )
        else:
            print(format_plan(plan, cfg))
        return 0
    plan = make_plan(cfg)
    print(format_plan(plan, cfg))
    try:
        run_dir = run_sweep(cfg, args.out, show_progress=not args.no_progress)
    except ValueError as e:
        print(f"slipstream sweep: {e}")
        return 2
    _print_summary(run_dir)
    return 0


def _print_summary(run_dir: Path) -> None:
    agg = json.loads((run_dir / "aggregates.json").read_text())
    print(f"\nrun directory: {run_dir}")
    for r in agg["recommendations"]:
        rec = r.get("recommended")
        if rec is None:
            print(f"  {r['config_id']}: no recommendation ({r['verdict']})")
            continue
        print(
            f"  {r['config_id']}: recommend {rec['density']:g} sandboxes/vCPU = {rec['num_sandboxes']} "
            f"sandboxes (amp G={r['g']} {rec['amplification']}, baseline {r['baseline_amplification']}); "
            f"{r['verdict']}"
        )
    print(f"  report: {run_dir / 'report.md'}")


def cmd_report(args: argparse.Namespace) -> int:
    from slipstream.sweep.report import REPORT, build_outputs

    run_dir = Path(args.run_dir)
    build_outputs(run_dir)
    if args.print:
        print((run_dir / REPORT).read_text())
    _print_summary(run_dir)
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from slipstream.sweep.report import compare_runs

    print(compare_runs(args.run_a, args.run_b))
    return 0
