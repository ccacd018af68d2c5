"""The job configs the README and guides show (configs/*.toml) load as they stand, and the
reasoning-gym one passes `slipstream task check` (every reference answer scores 1, every empty
completion 0) — a renamed key, a bad gym option or an agent command that `agent.preload` refuses
fails here, not on a user's first run."""

from __future__ import annotations

from pathlib import Path

import pytest

from slipstream.cli import main
from slipstream.config import load_config

ROOT = Path(__file__).resolve().parents[2]
JOB_CONFIGS = sorted(p.name for p in (ROOT / "configs").glob("*.toml"))


def test_the_job_configs_are_the_ones_the_guides_show() -> None:
    assert JOB_CONFIGS == ["agent.toml", "agentic.toml", "gym.toml", "quickstart.toml", "rlhf.toml"]


@pytest.mark.parametrize("name", JOB_CONFIGS)
def test_a_shipped_config_loads_as_it_stands(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)  # the guides run them from the repository root
    cfg = load_config(ROOT / "configs" / name)
    assert cfg.run.output_dir.startswith("runs/")


def test_agent_config_preloads_openai_for_its_python_agent() -> None:
    cfg = load_config(ROOT / "configs" / "agent.toml")
    assert cfg.task.env == "agent" and cfg.agent.preload == ["openai"]


def test_gym_config_passes_task_check(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    assert main(["task", "check", "-c", "configs/gym.toml"]) == 0
