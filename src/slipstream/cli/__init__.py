"""`slipstream`: one entry point, one module per subcommand.

Each subcommand module exposes `register(subparsers)`, which adds its parser and sets
`func=handler(args) -> int`. Config-taking commands accept `-c FILE` plus any number of dotted
overrides (`--trainer.lr=3e-4` or `--trainer.lr 3e-4`), collected into `args.overrides`.

Errors a user can act on end in one line on stderr, never a traceback: a config error (exit 2),
a store error (`slipstream.storage.errors`: a corrupt entry, another job holding the lock, NaN
weights; exit 1), an OS error (ENOSPC, EACCES, EROFS, a file where a directory should be, a
missing checkpoint; exit 1) as `slipstream: PATH: reason`. SLIPSTREAM_TRACEBACK=1 re-raises them
with the traceback, for debugging.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

# Idle OpenMP threads sleep instead of spinning. Set before any subcommand imports torch (libgomp
# reads it when it loads): on a shared or oversubscribed machine, spinning threads made 2-thread
# training 20-60x slower than 1-thread (measured, docs/tasks-and-sft.md). A user's value is kept.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from slipstream.config import ConfigError
from slipstream.config.args import add_config_args
from slipstream.rl.types import RolloutFailed, TrainerRankLost
from slipstream.storage.errors import StoreError

__all__ = [
    "add_config_args",
    "build_parser",
    "main",
    "os_error_line",
    "register_modules",
    "split_overrides",
]

# Subcommand modules, in the order `--help` lists them.
SUBCOMMANDS = [
    "run",
    "sft",
    "rm",
    "eval",
    "serve",
    "sandbox",
    "sweep",
    "bench",
    "ckpt",
    "config_cmd",
    "plan",
    "task",
]

EPILOG = """\
Config: every job command takes -c FILE (TOML) and dotted overrides such as --trainer.lr=3e-4.
`slipstream config show -c FILE` prints the fully resolved config; `slipstream config schema` lists
every key with its type, default and meaning.

Guides: docs/README.md (one line per page, by what you want to do); each command's --help names
its own page."""

# The guide page each command's --help names, by its path of subcommand names; a command not
# listed takes its parent's page. tests/unit/test_cli_guides.py checks every command has one
# and every page exists.
GUIDES: dict[tuple[str, ...], str] = {
    ("run",): "docs/rl.md",
    ("sft",): "docs/tasks-and-sft.md",
    ("rm",): "docs/rlhf.md",
    ("eval",): "docs/tasks-and-sft.md",
    ("serve",): "docs/engine.md",
    ("sandbox",): "docs/sandbox.md",
    ("sandbox", "build-image"): "docs/sandbox-vms.md",
    ("sweep",): "docs/sweep.md",
    ("bench",): "docs/performance.md",
    ("bench", "engine"): "docs/engine.md",
    ("bench", "pipeline"): "docs/rl.md",
    ("bench", "sandbox"): "docs/sandbox.md",
    ("bench", "moe-experts"): "docs/moe-ep.md",
    ("bench", "moe-dispatch"): "docs/moe-ep.md",
    ("bench", "moe-train"): "docs/moe-ep.md",
    ("bench", "r3"): "docs/rl.md",
    ("bench", "weights"): "docs/weights.md",
    ("bench", "rm"): "docs/rlhf.md",
    ("bench", "peer"): "docs/rl.md",
    ("ckpt",): "docs/rl.md",
    ("config",): "docs/architecture.md",
    ("plan",): "docs/plan.md",
    ("task",): "docs/data.md",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="slipstream",
        description="Asynchronous RL post-training of Mixture-of-Experts LMs with verifiable rewards.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    register_modules(sub, "slipstream.cli", SUBCOMMANDS)
    bound_numeric_flags(parser)
    name_guides(parser, ())
    return parser


class ParagraphHelpFormatter(argparse.HelpFormatter):
    """argparse's default formatter, but each blank-line-separated paragraph of a description or
    epilog is filled on its own (the default joins them into one)."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        return "\n\n".join(super(ParagraphHelpFormatter, self)._fill_text(p, width, indent)
                           for p in text.split("\n\n"))  # fmt: skip


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """The parsers of `parser`'s subcommands by name (aliases included), or {}."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def guide_of(path: tuple[str, ...]) -> str | None:
    """The guide page of a command path: its own entry in GUIDES, else its nearest parent's."""
    for n in range(len(path), 0, -1):
        if path[:n] in GUIDES:
            return GUIDES[path[:n]]
    return None


def name_guides(parser: argparse.ArgumentParser, path: tuple[str, ...]) -> None:
    """Every subcommand's --help ends with the guide page that explains it."""
    for name, child in subcommands(parser).items():
        page = guide_of((*path, name))
        if page is not None:
            line = f"Guide: {page}"
            child.epilog = f"{child.epilog}\n\n{line}" if child.epilog else line
            if child.formatter_class is argparse.HelpFormatter:  # keep the guide on its own line
                child.formatter_class = ParagraphHelpFormatter
        name_guides(child, (*path, name))


def bound_numeric_flags(parser: argparse.ArgumentParser) -> None:
    """Every int/float flag of every subcommand is a count, size, rate or duration: it must be
    finite and in [0, ceiling], with the config's ceilings (config/base.py: int32, 1e9 s for
    `*_s` flags, float32), or it is a usage error (rc 2) before the command runs: `-1`, `nan` or
    `1e308` used to reach the commands and end in tracebacks or nonsense runs."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                bound_numeric_flags(child)
        elif action.type in (int, float):
            action.type = _bounded(action.type, action.dest.endswith("_s"))


def _bounded(kind: type, seconds: bool):  # noqa: ANN202 - an argparse type
    from slipstream.config.base import MAX_FLOAT, MAX_INT, MAX_SECONDS

    ceiling = MAX_INT if kind is int else MAX_SECONDS if seconds else MAX_FLOAT

    def parse(text: str) -> int | float:
        value = kind(text)
        if not (value == value and 0 <= value <= ceiling):  # NaN fails value == value
            raise argparse.ArgumentTypeError(
                f"{text[:40]!r} is out of range: must be in [0, {ceiling:,}]"
            )
        return value

    parse.__name__ = kind.__name__  # argparse says "invalid int value" for what int() refuses
    parse.kind = kind  # type: ignore[attr-defined]
    return parse


def register_modules(sub: argparse._SubParsersAction, package: str, names: list[str]) -> None:
    """Import `package.<name>` for each name and let it add its parser(s) to `sub`."""
    for name in names:
        importlib.import_module(f"{package}.{name}").register(sub)


def split_overrides(argv: list[str]) -> tuple[list[str], list[str]]:
    """Separate dotted overrides (`--a.b=v`, `--a.b v`) from ordinary arguments."""
    rest: list[str] = []
    overrides: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            rest.extend(argv[i:])
            break
        if arg.startswith("--") and "." in arg.split("=", 1)[0]:
            if "=" in arg:
                overrides.append(arg[2:])
            elif i + 1 < len(argv):
                overrides.append(f"{arg[2:]}={argv[i + 1]}")
                i += 1
            else:
                raise ConfigError(f"override {arg} has no value")
        else:
            rest.append(arg)
        i += 1
    return rest, overrides


def os_error_line(e: OSError) -> str:
    """`PATH: reason` (`PATH -> PATH2: reason` for renames), or the message when it names no
    path itself (e.g. `no checkpoint at DIR`)."""
    reason = e.strerror or str(e) or type(e).__name__
    if e.filename is None:
        return str(e) or type(e).__name__
    where = str(e.filename) + (f" -> {e.filename2}" if e.filename2 is not None else "")
    return f"{where}: {reason}"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    try:
        rest, overrides = split_overrides(argv)
        args = parser.parse_args(rest)
        args.overrides = overrides
        if not getattr(args, "func", None):
            parser.print_help()
            return 2
        if overrides and not getattr(args, "takes_config", False):
            parser.error(f"{args.command} takes no config overrides: {' '.join(overrides)}")
        return int(args.func(args) or 0)
    except ConfigError as e:
        print(f"slipstream: {e}", file=sys.stderr)
        return 2
    except RolloutFailed as e:  # e.g. a worker slot crash-loops: the reason ends with its output
        print(f"slipstream: {e}", file=sys.stderr)
        return 1
    except (TrainerRankLost, FloatingPointError) as e:  # a lost rank's cause is in its log
        print(f"slipstream: {e}", file=sys.stderr)
        return 1
    except StoreError as e:  # before OSError: InvalidEntry is both
        if os.environ.get("SLIPSTREAM_TRACEBACK"):
            raise
        print(f"slipstream: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("slipstream: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # output piped into `head` & co.: stop quietly, and keep Python's exit-time flush quiet too
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except OSError as e:  # ENOSPC, EACCES, EROFS, a file as output_dir, a missing checkpoint
        if os.environ.get("SLIPSTREAM_TRACEBACK"):
            raise
        print(f"slipstream: {os_error_line(e)}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
