import subprocess
import sys

import pytest

from slipstream.cli import main, split_overrides
from slipstream.config import ConfigError, load_config, parse_override


def test_defaults_load_without_file():
    cfg = load_config()
    assert cfg.trainer.lr > 0


def test_override_types_are_parsed():
    assert parse_override("trainer.lr=3e-4") == (["trainer", "lr"], 3e-4)
    assert parse_override("--run.output_dir=/tmp/x") == (["run", "output_dir"], "/tmp/x")
    assert parse_override("model.mlp_only_layers=[0, 1]") == (["model", "mlp_only_layers"], [0, 1])
    cfg = load_config(None, ["trainer.lr=3e-4", "model.norm_topk_prob=false"])
    assert cfg.trainer.lr == 3e-4 and cfg.model.norm_topk_prob is False


def test_errors_name_key_value_and_file(tmp_path):
    f = tmp_path / "bad.toml"
    f.write_text('[trainer]\nlr = "fast"\nlearning_rate = 1\n[rollout]\ngroup_size = 0\n')
    with pytest.raises(ConfigError) as e:
        load_config(f)
    msg = str(e.value)
    assert str(f) in msg
    assert "trainer.lr = 'fast'" in msg
    assert "trainer.learning_rate = 1: unknown key" in msg
    assert "rollout.group_size = 0" in msg and "greater than or equal to 1" in msg


def test_override_error_names_command_line():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["trainer.lr=-1"])
    assert "command-line" in str(e.value) and "trainer.lr = -1" in str(e.value)


def test_http_engine_needs_a_url():
    with pytest.raises(ConfigError, match="engine.type = 'http' needs engine.url"):
        load_config(None, ["engine.type=http"])
    assert (
        load_config(None, ["engine.type=http", "engine.url=http://h:1"]).engine.url == "http://h:1"
    )


def test_missing_file_and_bad_toml(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[trainer\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad)


def test_split_overrides():
    rest, ov = split_overrides(["sft", "-c", "x.toml", "--trainer.lr", "1e-3", "--sft.steps=5"])
    assert rest == ["sft", "-c", "x.toml"]
    assert ov == ["trainer.lr=1e-3", "sft.steps=5"]


def test_config_show_cli(tmp_path, capsys):
    assert main(["config", "show", "--trainer.lr=0.5"]) == 0
    out = capsys.readouterr().out
    assert "[trainer]" in out and "lr = 0.5" in out
    assert main(["config", "show", "--trainer.nope=1"]) == 2
    assert "trainer.nope = 1: unknown key" in capsys.readouterr().err


def test_config_module_imports_without_torch():
    code = "import sys, slipstream.config; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_without_c_job_commands_load_the_embedded_quickstart(capsys):
    """`slipstream run` alone runs what `make run` runs: the packaged quickstart, which is the
    file configs/quickstart.toml points at."""
    from pathlib import Path

    from slipstream.config import QUICKSTART

    repo_copy = Path(__file__).parents[2] / "configs" / "quickstart.toml"
    assert repo_copy.resolve() == QUICKSTART.resolve()
    assert main(["config", "show"]) == 0
    bare = capsys.readouterr().out
    assert main(["config", "show", "-c", str(repo_copy)]) == 0
    assert capsys.readouterr().out == bare
    assert load_config(QUICKSTART) != load_config(None)  # the quickstart is not the bare defaults
