"""`slipstream sft`: supervised warm start on the task's demonstrations (see slipstream.sft)."""

from __future__ import annotations

import argparse
import os

from slipstream.cli import add_config_args
from slipstream.config import load_config


def prefer_passive_omp() -> None:
    """Idle OpenMP threads sleep instead of spinning. Call before torch is imported (libgomp reads
    the variable when it loads). Why: on a shared machine a spinning thread whose sibling was
    descheduled burns its core; we measured 2-thread SFT 20-60x slower than 1-thread under load
    with the default policy, and on par with this one. A value the user set is kept."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "sft",
        help="train the policy on task demonstrations and save an HF-format checkpoint",
        description="Supervised warm start: trains the MoE policy on [task] demonstrations per [sft], "
        "writes <run.output_dir>/sft/metrics.jsonl and <run.output_dir>/sft/checkpoint/ "
        "(config.json, safetensors, tokenizer). Example: slipstream sft -c configs/quickstart.toml "
        "--sft.steps=100",
    )
    add_config_args(p)
    p.set_defaults(func=cmd_sft)


def cmd_sft(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)  # fails on a bad config before torch loads
    prefer_passive_omp()
    from slipstream.sft import run_sft
    from slipstream.storage.lock import job_locks

    with job_locks(cfg, owner="slipstream sft", store=False):  # one writer of run.output_dir
        run_sft(cfg)
    return 0
