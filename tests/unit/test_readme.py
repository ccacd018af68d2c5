"""The README is the front door (issue 49): under 10 kB, and every command, config and snippet in
it runs, so it cannot rot. Shell lines are parsed by the real CLI (and their -c config loaded with
their overrides, so a renamed key fails here); a TOML block must be copied verbatim from a file
under configs/ or examples/ that loads (and that other tests run); the Python snippet runs against
a real `slipstream serve`-style server in tests/integration/test_readme_snippet.py."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from slipstream.cli import build_parser, split_overrides
from slipstream.config import load_config

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README, flags=re.S)


def shell_commands() -> list[list[str]]:
    out = []
    for block in blocks("bash"):
        for line in block.splitlines():
            line = line.split("  #")[0].strip()
            if line:
                out.append(shlex.split(line))
    return out


def test_readme_is_a_short_guide() -> None:
    assert len(README.encode()) < 10_000, f"README.md is {len(README.encode())} bytes"
    first = blocks("bash")[0].splitlines()
    assert [line.split("#")[0].strip() for line in first] == ["make run", "make test"]


def test_every_readme_command_parses_and_its_config_loads() -> None:
    commands = shell_commands()
    slipstream = [c for c in commands if c[0].endswith("bin/slipstream")]
    assert len(slipstream) >= 6, commands
    for argv in commands:
        while "=" in argv[0] and not argv[0].startswith((".", "/")):  # VAR=value prefixes
            argv = argv[1:]
        if argv[0] == ".venv/bin/python":
            assert (ROOT / argv[1]).is_file(), f"README runs a script that is not there: {argv}"
            continue
        if argv[0] == "make":
            assert argv[1] in {"run", "test"}, argv
            continue
        assert argv[0] == ".venv/bin/slipstream", f"README runs something unchecked: {argv}"
        rest, overrides = split_overrides(argv[1:])
        args = build_parser().parse_args(rest)
        assert args.func is not None, argv
        if getattr(args, "takes_config", False):
            cfg_file = getattr(args, "config", None)
            load_config(cfg_file and str(ROOT / cfg_file), overrides)
        else:
            assert not overrides, argv


def test_every_readme_config_is_copied_from_a_tested_file() -> None:
    tomls = blocks("toml")
    assert tomls, "the README shows no config"
    files = [*ROOT.glob("configs/*.toml"), *ROOT.glob("examples/**/*.toml")]
    for block in tomls:  # each paragraph verbatim, all from one file
        parts = [part.strip() for part in block.split("\n\n") if part.strip()]
        sources = [f for f in files if all(part in f.read_text() for part in parts)]
        assert sources, f"this README config is in no file under configs/ or examples/:\n{block}"
        for f in sources:
            load_config(str(f), [])
