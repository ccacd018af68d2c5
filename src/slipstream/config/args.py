"""The command-line side of job configs: `-c FILE` for every command (and benchmark) that takes
a job config; the dotted overrides after it are collected by `slipstream.cli.main`.
Imports without torch (argparse only)."""

from __future__ import annotations

import argparse


def add_config_args(parser: argparse.ArgumentParser, *, quickstart_default: bool = True) -> None:
    """-c FILE for commands that take a job config; overrides are collected by main().
    Without -c, job commands load the embedded quickstart (`slipstream.config.QUICKSTART`), so
    `slipstream run` alone runs what `make run` runs; `quickstart_default=False` leaves the
    default to the command (None: the config model's built-in defaults)."""
    from slipstream.config import QUICKSTART

    parser.add_argument(
        "-c",
        "--config",
        metavar="FILE",
        default=str(QUICKSTART) if quickstart_default else None,
        help=(
            "TOML config (default: the embedded quickstart, configs/quickstart.toml)"
            if quickstart_default
            else "TOML config (default: built-in defaults)"
        )
        + ". Any --section.key=value after it overrides a single key.",
    )
    parser.set_defaults(takes_config=True)
