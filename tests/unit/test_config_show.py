"""`slipstream config show` prints TOML that loads back to the same resolved config."""

from __future__ import annotations

import contextlib
import io
import tomllib
from pathlib import Path

import pytest

from slipstream.cli import main
from slipstream.config import load_config

CONFIGS = sorted(Path("configs").glob("*.toml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_show_round_trips(path: Path, tmp_path: Path) -> None:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["config", "show", "-c", str(path)]) == 0
    text = out.getvalue()
    tomllib.loads(text)  # valid TOML: inline tables, lists of tables, unset keys
    shown = tmp_path / "shown.toml"
    shown.write_text(text)
    assert load_config(shown).model_dump() == load_config(path).model_dump()
