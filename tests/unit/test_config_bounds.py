"""Every numeric config key is bounded at load (issues 32, 44): every key that `slipstream config
schema` lists is walked (not sampled) at the edges of its range, and every numeric command-line
flag gets extreme values.

Config keys: each key's own bounds (ge/gt/le/lt), else the ceiling of its kind (int32, 1e9 s
for `*_s`, float32) in both directions: the edge loads, one step beyond is a config error (one
header line, then exactly one line that names the key); beyond int32 (integer keys) and beyond
float32 (float keys) always is. Through `slipstream config show`: rc 2, never a traceback, and
the read-only command creates no file (an empty directory with an empty HOME).
Flags: every int/float option of every subcommand, given a negative, non-finite, too large or
unconvertible value (-1, nan, 1e308, 2**63, 1e20 for an int, a 10,000-character string), is a
usage error (rc 2) before the command runs.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from slipstream.cli import build_parser, main
from slipstream.config.base import MAX_FLOAT, MAX_INT, MAX_SECONDS

EXTREME = ["1e20", "1e308", "-1e20", "-1e308", str(2**63), str(-(2**63)), "9" * 400]
BEYOND_FLOAT32 = ["1e308", "-1e308", "9" * 400]
"""Out of range for every key: beyond float32 (floats) and beyond int32 (ints: all of EXTREME)."""


def _schema_keys(capsys) -> dict[str, str]:
    """key -> type name, as `slipstream config schema` prints them."""
    assert main(["config", "schema"]) == 0
    out = capsys.readouterr().out
    return dict(re.findall(r"^(\w+\.\w+)  \((\w+)", out, flags=re.M))


@pytest.fixture
def empty_cwd(tmp_path: Path, monkeypatch) -> Path:
    home = tmp_path / "home"
    work = tmp_path / "work"
    home.mkdir()
    work.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    return tmp_path


def test_schema_lists_numeric_keys(capsys) -> None:
    keys = _schema_keys(capsys)
    numeric = [k for k, t in keys.items() if t in ("int", "float")]
    assert len(numeric) > 80, numeric
    assert {"run.num_threads", "eval.k", "eval.temperature", "sandbox.memory_mib"} <= set(numeric)


def test_config_bounds_agree_with_the_engine() -> None:
    from slipstream.config import SlipstreamConfig
    from slipstream.engine.base import MAX_SAMPLES, MAX_TEMPERATURE

    def le(section: str, key: str) -> float:
        field = SlipstreamConfig.model_fields[section].annotation.model_fields[key]
        return next(m.le for m in field.metadata if hasattr(m, "le"))

    assert le("eval", "temperature") == le("rollout", "temperature") == MAX_TEMPERATURE
    assert le("eval", "k") == MAX_SAMPLES


def _numeric_keys() -> list[tuple[str, str]]:
    """(key, "int" | "float") of every numeric key `slipstream config schema` lists."""
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["config", "schema"]) == 0
    keys = dict(re.findall(r"^(\w+\.\w+)  \((\w+)", out.getvalue(), flags=re.M))
    return sorted((k, t) for k, t in keys.items() if t in ("int", "float"))


NUMERIC_KEYS = _numeric_keys()


def _boundaries(key: str, kind: str) -> tuple[list[str], list[str]]:
    """(values the key must take, values it must refuse) at the edges of its range: its own
    ge/gt/le/lt, else the ceiling of its kind (MAX_INT, MAX_SECONDS for `*_s`, MAX_FLOAT) in
    either direction; and the universal extremes beyond int32 / float32."""
    from annotated_types import Ge, Gt, Le, Lt

    from slipstream.config import SlipstreamConfig

    section, name = key.split(".")
    meta = SlipstreamConfig.model_fields[section].annotation.model_fields[name].metadata
    attr = {Ge: "ge", Gt: "gt", Le: "le", Lt: "lt"}
    own = {type(m): getattr(m, attr[type(m)]) for m in meta if type(m) in attr}
    ceiling = MAX_INT if kind == "int" else MAX_SECONDS if name.endswith("_s") else MAX_FLOAT
    step = (lambda v: 1) if kind == "int" else (lambda v: max(abs(v) * 1e-6, 1e-9))
    fmt = str if kind == "int" else (lambda v: repr(float(v)))
    take, refuse = [], []
    if Le in own:
        take.append(own[Le])
        refuse.append(own[Le] + step(own[Le]))
    elif Lt in own:
        take.append(own[Lt] - step(own[Lt]))
        refuse.append(own[Lt])
    else:
        take.append(ceiling)
        refuse.append(ceiling + 1 if kind == "int" else ceiling * 1.01)
    if Ge in own:
        take.append(own[Ge])
        refuse.append(own[Ge] - step(own[Ge]))
    elif Gt in own:
        take.append(own[Gt] + step(own[Gt]))
        refuse.append(own[Gt])
    elif Le not in own and Lt not in own:  # no bound of its own: the ceiling both ways
        take.append(-ceiling)
        refuse.append(-ceiling - 1 if kind == "int" else -ceiling * 1.01)
    refuse += EXTREME if kind == "int" else BEYOND_FLOAT32
    return [fmt(v) for v in take], [v if isinstance(v, str) else fmt(v) for v in refuse]


@pytest.mark.parametrize(("key", "kind"), NUMERIC_KEYS, ids=[k for k, _ in NUMERIC_KEYS])
def test_every_numeric_key_takes_its_range_and_refuses_beyond_it(key: str, kind: str) -> None:
    """Every key `config schema` lists (not a sample of them), at both edges of its range: the
    edge loads, one step beyond it is a config error whose one line names the key; beyond
    int32 / float32 always is. (A value inside the range may still be refused by a check across
    keys: that error names the section, never this key's value.)"""
    from slipstream.config import load_config
    from slipstream.config.base import ConfigError

    take, refuse = _boundaries(key, kind)
    for value in take:
        try:
            load_config(None, [f"{key}={value}"])
        except ConfigError as e:
            lines = str(e).split("\n")
            assert len(lines) == 2 and not lines[1].startswith(f"  {key} = "), (key, value, str(e))
    for value in refuse:
        with pytest.raises(ConfigError) as info:
            load_config(None, [f"{key}={value}"])
        lines = str(info.value).split("\n")  # not splitlines(): a value may hold U+0085 & co.
        assert lines[0].startswith("invalid config") and len(lines) == 2, (key, value, lines)
        assert lines[1].startswith(f"  {key} = "), (key, value, lines)
        assert max(map(len, lines)) < 400  # a huge value is not echoed whole


def test_the_walk_covers_every_kind_of_bound() -> None:
    """The walk reads each key's own bounds: some keys have le, lt, ge, gt, and some none."""
    assert len(NUMERIC_KEYS) > 100
    bounded = {k: _boundaries(k, t) for k, t in NUMERIC_KEYS}
    assert bounded["run.num_threads"] == (["4096", "0"], ["4097", "-1", *EXTREME])  # le, ge
    assert bounded["run.seed"] == ([str(MAX_INT), "0"], [str(MAX_INT + 1), "-1", *EXTREME])
    assert bounded["eval.temperature"][1][:2] == ["1000001.0", "0.0"]  # le, gt
    # no bound of its own: the ceiling of its kind, both ways
    assert bounded["trainer.batch_timeout_s"][0][0] == repr(MAX_SECONDS)
    assert bounded["model.rope_theta"][0][0] == repr(MAX_FLOAT)


def test_extreme_values_through_the_cli_are_one_line_errors(capsys, empty_cwd):
    """`slipstream config show --KEY=VALUE`: rc 2 and the house's error (a header line, then one
    line naming the key), never a traceback, and the read-only command creates no file."""
    for key, value in (("run.seed", str(2**63)), ("trainer.lr", "1e308"),
                       ("engine.request_timeout_s", "-1e308"), ("eval.k", "9" * 400)):  # fmt: skip
        assert main(["config", "show", f"--{key}={value}"]) == 2
        out, err = capsys.readouterr()
        assert "Traceback" not in err + out
        lines = err.strip().split("\n")
        assert lines[0].startswith("slipstream: invalid config"), err
        assert len(lines) == 2 and lines[1].startswith(f"  {key} = "), err
    assert not any(empty_cwd.rglob("*.*")), sorted(empty_cwd.rglob("*"))


def test_the_bound_is_what_each_kind_of_key_can_take(capsys) -> None:
    for key, ok, too_big in (("run.seed", str(MAX_INT), str(MAX_INT + 1)),
                             ("engine.request_timeout_s", str(MAX_SECONDS), "1.1e9"),
                             ("trainer.lr", "1e3", str(MAX_FLOAT * 2)),
                             ("run.num_threads", "4096", "4097"),
                             ("sandbox.memory_mib", str(1 << 20), str((1 << 20) + 1))):  # fmt: skip
        assert main(["config", "show", f"--{key}={ok}"]) == 0, capsys.readouterr().err
        capsys.readouterr()
        assert main(["config", "show", f"--{key}={too_big}"]) == 2
        assert f"{key} = " in capsys.readouterr().err


def _numeric_flags() -> list[tuple[list[str], str, type]]:
    """(subcommand path, option string, type) of every int/float option of every subcommand."""
    found = []

    def walk(parser: argparse.ArgumentParser, path: list[str]) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(sub, [*path, name])
            elif hasattr(action.type, "kind") and action.option_strings:  # bound_numeric_flags
                found.append((path, action.option_strings[-1], action.type.kind))
            else:
                assert action.type not in (int, float), (path, action.option_strings)

    walk(build_parser(), [])
    return found


FLAGS = _numeric_flags()


def test_the_flag_walk_finds_the_numeric_flags() -> None:
    names = {(" ".join(p), o) for p, o, _ in FLAGS}
    assert ("serve", "--port") in names and ("plan search", "--budget-per-hour") in names, names
    assert len(FLAGS) > 20


@pytest.mark.parametrize(("path", "flag", "kind"), FLAGS,
                         ids=[f"{' '.join(p)} {o}" for p, o, _ in FLAGS])  # fmt: skip
def test_out_of_range_values_for_every_numeric_flag_are_usage_errors(path, flag, kind, capsys,
                                                                     empty_cwd):  # fmt: skip
    """Refused while parsing. Only the parser runs here: a value that slipped through must not
    start the command (a sweep or a benchmark), so a regression fails as DID NOT RAISE."""
    extreme = ["-1", "x" * 10_000]
    extreme += ["1e20", str(2**63)] if kind is int else ["nan", "inf", "-inf", "1e308", "-1e-300"]
    parser = build_parser()
    for value in extreme:
        with pytest.raises(SystemExit) as info:
            parser.parse_args([*path, f"{flag}={value}"])
        err = capsys.readouterr().err
        assert info.value.code == 2 and "Traceback" not in err, err
        last = err.strip().split("\n")[-1]
        assert "error: argument" in last and flag in last, err
    assert not any(empty_cwd.rglob("*.*"))
