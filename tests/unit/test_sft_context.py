"""SFT refuses demonstrations longer than the model's context, naming the key, before a step."""

from __future__ import annotations

from pathlib import Path

import pytest

from slipstream.config import ConfigError, load_config
from slipstream.sft import run_sft


def test_sft_refuses_episodes_longer_than_the_context(tmp_path: Path) -> None:
    # The code task's prompts are ~210 tokens; the quickstart model has 64 positions.
    cfg = load_config(
        None,
        [
            "task.name=code",
            "sft.steps=2",
            "sft.batch_size=2",
            "model.max_position_embeddings=64",
            f"run.output_dir={tmp_path}",
        ],
    )
    with pytest.raises(
        ConfigError, match=r"model\.max_position_embeddings = 64: task\.name = 'code'"
    ):
        run_sft(cfg)
    assert not (tmp_path / "sft" / "checkpoint").exists()


def test_sft_runs_when_the_context_fits(tmp_path: Path) -> None:
    cfg = load_config(
        None,
        [
            "task.name=code",
            "sft.steps=1",
            "sft.batch_size=2",
            "model.max_position_embeddings=512",
            f"run.output_dir={tmp_path}",
        ],
    )
    assert run_sft(cfg).steps == 1
