"""`slipstream eval`: held-out pass@1 (greedy) and pass@k (sampled) of a checkpoint."""

from __future__ import annotations

import argparse

from slipstream.cli import add_config_args
from slipstream.cli.sft import prefer_passive_omp
from slipstream.config import load_config


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "eval",
        help="held-out pass@1 (greedy) and pass@k (sampled) of a checkpoint",
        description="Evaluates a checkpoint on the held-out split of [task] per [eval]; prints a table "
        "and writes <run.output_dir>/eval/results.json.",
    )
    add_config_args(p)
    p.add_argument(
        "--checkpoint",
        metavar="DIR",
        default=None,
        help="HF-format checkpoint directory (default: eval.checkpoint, else "
        "<run.output_dir>/sft/checkpoint)",
    )
    p.set_defaults(func=cmd_eval)


def cmd_eval(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)
    prefer_passive_omp()
    from slipstream.evaluate import run_eval
    from slipstream.sft import sft_dir

    run_eval(cfg, args.checkpoint or cfg.eval.checkpoint or sft_dir(cfg) / "checkpoint")
    return 0
