"""Rates files: errors name key, value and file; TOML round trip; distributions; the CLI's
error path."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from slipstream.config.base import ConfigError
from slipstream.plan import PlanConfig, dump_toml, load_rates, with_overrides
from slipstream.plan.dists import Dist, Sampler, dist_mean, sweep_densities


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "rates.toml"
    path.write_text(text)
    return path


def test_unknown_key_names_key_value_and_file(tmp_path: Path) -> None:
    path = write(tmp_path, "[trainer]\nnum_nodes = 4\nstep_seconds = 2.0\n")
    with pytest.raises(ConfigError) as e:
        load_rates(path)
    msg = str(e.value)
    assert str(path) in msg and "trainer.step_seconds = 2.0: unknown key" in msg


def test_bad_value_names_key_value_and_file(tmp_path: Path) -> None:
    path = write(tmp_path, '[rollout.spot]\nnotice_s = "two minutes"\n')
    with pytest.raises(ConfigError) as e:
        load_rates(path)
    assert "rollout.spot.notice_s = 'two minutes'" in str(e.value) and str(path) in str(e.value)
    with pytest.raises(ConfigError, match=r"loop.group_size = 0"):
        load_rates(None, ["loop.group_size=0"])


def test_cross_field_rules(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="warmup_steps"):
        load_rates(None, ["loop.steps=3", "loop.warmup_steps=3"])
    with pytest.raises(ConfigError, match="max_batch_rows"):
        load_rates(None, ["rollout.engine.max_batch_rows=4", "loop.group_size=8"])
    with pytest.raises(ConfigError, match="num_nodes >= 1"):
        load_rates(None, ['verifier.pool="shared"'])
    with pytest.raises(ConfigError, match="divisible"):
        load_rates(None, ["trainer.ep.num_experts=10", "trainer.ep.ep_nodes=4"])
    with pytest.raises(ConfigError, match="p50 > 0"):
        load_rates(None, ['verifier.latency_s={kind="lognormal"}'])
    with pytest.raises(ConfigError, match="needs `path`"):
        load_rates(None, ['verifier.latency_s={kind="sweep"}'])


def test_missing_file_and_bad_toml(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_rates(tmp_path / "nope.toml")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_rates(write(tmp_path, "[loop\n"))


def test_dump_toml_round_trips(tmp_path: Path) -> None:
    plan = load_rates("configs/plan/p5en-48.toml")
    plan.calibration.measured = {"a_s": 1.5, "b": 2.0}
    plan.calibration.notes = ['with "quotes"', "and\\backslash"]
    plan.trainer.step_s = Dist(kind="empirical", values=[0.1, 0.2], order="sequential")
    path = tmp_path / "out.toml"
    path.write_text(dump_toml(plan, header="made by a test\nsecond line"))
    again = load_rates(path)
    assert again == plan


def test_p5en_example_loads_and_resolves_the_sweep_samples() -> None:
    plan = load_rates("configs/plan/p5en-48.toml")
    assert plan.trainer.num_nodes == 16 and plan.rollout.num_instances * 2 == 32
    path = plan.verifier.latency_s.path
    assert Path(path).is_absolute() and Path(path).is_file()
    assert sweep_densities(path, plan.verifier.latency_s.config_id) == [0.5, 1.0, 1.5, 2.0]


def test_distributions_draw_what_they_say() -> None:
    rng = np.random.default_rng(0)
    logn = Dist(kind="lognormal", p50=2.0, p99_over_p50=5.0)
    x = Sampler(logn, rng).draw(200_000)
    assert np.median(x) == pytest.approx(2.0, rel=0.02)
    assert np.quantile(x, 0.99) / np.median(x) == pytest.approx(5.0, rel=0.05)
    assert x.mean() == pytest.approx(dist_mean(logn), rel=0.02)
    seq = Sampler(Dist(kind="empirical", values=[1, 2, 3], order="sequential"), rng)
    assert [seq.draw_one() for _ in range(5)] == [1, 2, 3, 1, 2]
    clipped = Dist(kind="exponential", value=1.0, scale=2.0, shift=1.0, max=2.5)
    y = Sampler(clipped, rng).draw(10_000)
    assert y.min() >= 1.0 and y.max() <= 2.5
    assert dist_mean(clipped) == pytest.approx(y.mean(), rel=0.03)


def test_overrides_on_a_loaded_plan() -> None:
    plan = with_overrides(PlanConfig(), ["rollout.num_instances=3"])
    assert plan.rollout.num_instances == 3
    with pytest.raises(ConfigError, match="rollout.num_instances = 0"):
        with_overrides(plan, ["rollout.num_instances=0"])


def test_cli_reports_a_config_error_and_exits_2(tmp_path: Path) -> None:
    path = write(tmp_path, "[loop]\ngroups_per_step = -1\n")
    code = "import sys; from slipstream.cli import main; sys.exit(main())"
    out = subprocess.run([sys.executable, "-c", code, "plan", "simulate", "-c", str(path)],
                         capture_output=True, text=True, check=False)  # fmt: skip
    assert out.returncode == 2
    assert "loop.groups_per_step = -1" in out.stderr and str(path) in out.stderr


def test_plan_subcommands_parse_their_options() -> None:
    from slipstream.cli import build_parser

    p = build_parser()
    v = p.parse_args(["plan", "validate", "--code-ref", "HEAD", "--reuse", "--cases", "sync-w1"])
    assert (v.code_ref, v.reuse, v.cases, v.func.__name__) == ("HEAD", True, "sync-w1",
                                                                "cmd_validate")  # fmt: skip
    c = p.parse_args(["plan", "calibrate", "runs/x", "-o", "r.toml", "--no-fit"])
    assert (c.run_dir, c.out, c.no_fit) == ("runs/x", "r.toml", True)
    w = p.parse_args(["plan", "search", "-c", "f.toml", "--target-samples-per-s", "30"])
    assert (w.config, w.target_samples_per_s, w.budget_per_hour) == ("f.toml", 30.0, None)
