"""`slipstream run`: the main job. Until the asynchronous RL loop lands it is: SFT warm start
(skipped when a complete checkpoint already exists) then held-out evaluation, printing the result."""

from __future__ import annotations

import argparse

from slipstream.cli import add_config_args
from slipstream.config import load_config


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "run",
        help="the main job: SFT warm start, then held-out evaluation",
        description="SFT warm start of the policy on [task] (skipped if <run.output_dir>/sft/checkpoint "
        "is complete, unless --force-sft), then held-out pass@1/pass@k evaluation.",
    )
    add_config_args(p)
    p.add_argument("--force-sft", action="store_true", help="retrain even if a checkpoint exists")
    p.set_defaults(func=cmd_run)


def cmd_run(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)
    from rich.console import Console

    from slipstream.evaluate import run_eval
    from slipstream.sft import checkpoint_complete, run_sft, sft_dir

    console = Console()
    ckpt = sft_dir(cfg) / "checkpoint"
    if checkpoint_complete(ckpt) and not args.force_sft:
        console.print(f"[bold]sft[/] skipped: checkpoint exists at {ckpt} (--force-sft retrains)")
    else:
        run_sft(cfg, console)
    report = run_eval(cfg, ckpt, console)
    console.print(
        f"[bold]result[/] {cfg.task.name} held-out pass@1 (greedy) = "
        f"{100 * report.pass_at_1_greedy:.1f}% over {report.num_prompts} prompts"
    )
    return 0
