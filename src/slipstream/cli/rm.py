"""`slipstream rm train` / `slipstream rm pairs`: Bradley-Terry reward models (docs/rlhf.md)."""

from __future__ import annotations

import argparse
import json

from slipstream.cli import add_config_args
from slipstream.cli.sft import prefer_passive_omp
from slipstream.config import load_config


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "rm",
        help="train a reward model from preference pairs (RLHF)",
        description="Reward models for [reward].source = reward_model | combined (docs/rlhf.md).",
    )
    rm_sub = p.add_subparsers(dest="rm_command", metavar="ACTION", required=True)
    t = rm_sub.add_parser(
        "train",
        help="Bradley-Terry reward model from preference pairs; held-out pairwise accuracy",
        description="Trains a scalar-head reward model per [rm] on rm.pairs (JSON lines "
        "{prompt, chosen, rejected}; made from the task when missing), reports held-out pairwise "
        "accuracy, and writes <run.output_dir>/rm/checkpoint (an HF "
        "Qwen3MoeForSequenceClassification that transformers loads).",
    )
    add_config_args(t)
    t.set_defaults(func=cmd_train)
    m = rm_sub.add_parser(
        "pairs",
        help="make preference pairs from the task's verifier on sampled SFT completions",
        description="Samples rm.pair_samples completions per train prompt from the SFT checkpoint, "
        "pairs passing with failing ones by the verifier, swaps rm.label_noise of them, and "
        "writes rm.pairs (default <run.output_dir>/rm/pairs.jsonl).",
    )
    add_config_args(m)
    m.set_defaults(func=cmd_pairs)


def cmd_train(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)
    prefer_passive_omp()
    from slipstream.rm.train import train_reward_model
    from slipstream.storage.lock import job_locks

    with job_locks(cfg, owner="slipstream rm train", store=False):
        train_reward_model(cfg)
    return 0


def cmd_pairs(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)
    prefer_passive_omp()
    from slipstream.rm.pairs import make_task_pairs
    from slipstream.rm.train import pairs_path, sft_checkpoint

    print(json.dumps(make_task_pairs(cfg, sft_checkpoint(cfg), pairs_path(cfg))))
    return 0
