"""`slipstream run`: the main job. SFT warm start when no start checkpoint exists (skipped when
<run.output_dir>/sft/checkpoint is complete or model.init_from is set), then the RL loop: the
trainer in this process and rollout.num_workers rollout workers (local processes, or Ray actors
with run.launcher = "ray"; launch/job.py drives the job), a
live progress display, JSON-lines metrics, TensorBoard events when installed, and a final report
with the reward curve (<run.output_dir>/report.md, reward_curve.png). One job per output
directory and per store: a second one is refused, naming the first (storage/lock.py).
Under torchrun with run.launcher = "torchx" (the TorchX component, launch/torchx.py) every trainer
rank runs this command: rank 0 is the job, the others follow it (launch/scheduled.py)."""

from __future__ import annotations

import argparse

from slipstream.cli import add_config_args
from slipstream.config import load_config


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "run",
        help="the main job: SFT warm start if needed, then asynchronous RL with rollout workers",
        description=__doc__,
    )
    add_config_args(p)
    p.add_argument(
        "--force-sft", action="store_true", help="retrain the SFT start even if it exists"
    )
    p.add_argument(
        "--plain", action="store_true", help="one line per step instead of the live table"
    )
    p.set_defaults(func=cmd_run)


def cmd_run(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)
    import logging

    if cfg.run.launcher == "torchx":
        from slipstream.launch.scheduled import follower_main, torchrun_rank

        if torchrun_rank():  # a trainer rank > 0: no job lock, no report; rank 0 drives
            return follower_main(cfg)

    from rich.console import Console

    from slipstream.launch.job import run_job
    from slipstream.storage.lock import job_locks

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    console = Console()
    with job_locks(cfg, owner="slipstream run"):  # StoreLocked if another job has either
        if args.force_sft and not cfg.model.init_from:
            from slipstream.sft import run_sft

            run_sft(cfg, console)
        result = run_job(cfg, console, display=not args.plain)

    def pct(x: float | None) -> str:
        return "-" if x is None else f"{100 * x:.1f}%"

    console.print(
        f"[bold]result[/] {cfg.task.name} held-out pass@1 (greedy): {pct(result.pass_at_1_before)} "
        f"-> {pct(result.pass_at_1_after)} after {result.steps} RL steps in {result.wall_s:.0f} s "
        f"({cfg.trainer.mode}, {result.samples_per_s:.1f} samples/s, trainer idle "
        f"{100 * result.trainer_idle_frac:.0f}%)"
    )
    return 0
