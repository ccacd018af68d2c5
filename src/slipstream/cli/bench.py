"""`slipstream bench NAME`: run one benchmark (figure vs baseline vs limit, JSON with provenance)."""

from __future__ import annotations

import argparse

from slipstream.cli import register_modules

# Benchmark modules under slipstream.bench, in the order `--help` lists them.
BENCHMARKS = [
    "engine",
    "pipeline",
    "sandbox",
    "moe_experts",
    "moe_dispatch",
    "moe_train",
    "r3",
    "limits",
    "train",
    "weights",
    "rm",
    "rewards",
    "peer",
    "agent",
]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench",
        help="run a benchmark: figure next to its baseline and limit, JSON with provenance",
        description="Benchmarks print the measured figure next to its baseline and its limit, "
        "measured in the same run, and write JSON with provenance under benchmarks/results/.",
    )
    bsub = p.add_subparsers(dest="bench_name", metavar="NAME", required=True)
    register_modules(bsub, "slipstream.bench", BENCHMARKS)
