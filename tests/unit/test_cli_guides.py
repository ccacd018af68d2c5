"""Every command's --help names the guide page that explains it (issue 49), and every page named
exists, so a renamed or removed page fails here rather than in a user's terminal."""

from __future__ import annotations

from pathlib import Path

from slipstream.cli import GUIDES, build_parser, guide_of, subcommands

ROOT = Path(__file__).resolve().parents[2]


def _paths(parser, prefix=()):
    for name, child in subcommands(parser).items():
        yield (*prefix, name), child
        yield from _paths(child, (*prefix, name))


def test_every_command_names_an_existing_guide_in_its_help() -> None:
    commands = dict(_paths(build_parser()))
    assert len(commands) >= 40, sorted(commands)
    for path, parser in commands.items():
        page = guide_of(path)
        assert page is not None, f"`slipstream {' '.join(path)}` names no guide page"
        assert (ROOT / page).is_file(), f"`slipstream {' '.join(path)}` names {page}: missing"
        assert parser.format_help().rstrip().endswith(f"Guide: {page}"), path


def test_every_guide_entry_is_a_real_command() -> None:
    commands = dict(_paths(build_parser()))
    stale = sorted(" ".join(p) for p in GUIDES if p not in commands)
    assert not stale, f"GUIDES names commands that do not exist: {stale}"
