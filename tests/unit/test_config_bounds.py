"""Every numeric config key is bounded at load (issue 32): a property test over the keys that
`slipstream config schema` lists, and over every numeric command-line flag, with extreme values.

Config keys: `slipstream config show --KEY=VALUE` with 1e20, 1e308, -1e20, 2**63, a huge
string, ... must end in rc 2 with the house's config error (one header line, then exactly one
line that names the key), or rc 0 for a value the key takes; never a traceback; and the
read-only command creates no file (run in an empty directory with an empty HOME). Beyond int32
(integer keys) and beyond float32 (float keys) is always rc 2; 1e20 for a float key without a
bound of its own loads (it is a float32).
Flags: every int/float option of every subcommand, given a negative, non-finite, too large or
unconvertible value (-1, nan, 1e308, 2**63, 1e20 for an int, a 10,000-character string), is a
usage error (rc 2) before the command runs.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

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


@settings(max_examples=150, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # fmt: skip
@given(data=st.data())
def test_extreme_values_for_every_numeric_key_are_one_line_errors(data, capsys, empty_cwd):
    keys = _schema_keys(capsys)
    numeric = sorted(k for k, t in keys.items() if t in ("int", "float"))
    key = data.draw(st.sampled_from(numeric), label="key")
    value = data.draw(st.sampled_from(EXTREME) | st.text(min_size=1, max_size=30)
                      | st.floats(allow_nan=False).map(repr)
                      | st.integers(min_value=-(2**70), max_value=2**70).map(str), label="value")  # fmt: skip
    rc = main(["config", "show", f"--{key}={value}"])
    out, err = capsys.readouterr()
    assert "Traceback" not in err + out
    assert not any(empty_cwd.rglob("*.*")), sorted(empty_cwd.rglob("*"))  # no file created
    if value in (EXTREME if keys[key] == "int" else BEYOND_FLOAT32):
        assert rc == 2, (key, value, out[-300:])
    assert rc in (0, 2), (key, value, err)
    if rc == 2:
        lines = err.strip().split("\n")  # not splitlines(): a value may hold U+0085 & co.
        assert lines[0].startswith("slipstream: invalid config"), err
        assert len(lines) == 2 and lines[1].startswith(f"  {key} = "), err
        assert max(map(len, lines)) < 400, err  # a huge value is not echoed whole


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
