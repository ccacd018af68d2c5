"""RL with `[[reward.functions]]` in real worker processes: every trained reward is the weighted
sum of its components (a per-sample python function, exact match, the task's verifier and a group
function), each step's record has every component's mean and None share; a function that keeps
failing stops the job with one line naming it, and nothing of it was ever trained."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from test_rl_loop import tiny_config

from slipstream.config.rm import RewardConfig
from slipstream.launch.local import LocalLauncher
from slipstream.rl.controller import Controller
from slipstream.rl.types import RolloutFailed

TESTS = str(Path(__file__).resolve().parents[1])
FUNCTIONS = [
    {"name": "verifier", "kind": "verifier", "weight": 0.5},
    {"name": "exact", "kind": "exact", "weight": 0.25},
    {"name": "len", "kind": "python", "function": "reward_fns:length_reward", "weight": 0.5},
    {"name": "na", "kind": "python", "function": "reward_fns:not_applicable"},
    {"name": "short", "kind": "python", "function": "reward_fns:rank_in_group", "group": True,
     "weight": 0.125},
]  # fmt: skip
WEIGHTS = {f["name"]: f.get("weight", 1.0) for f in FUNCTIONS}


def run_job(tmp_path: Path, functions: list[dict], *overrides: str):  # type: ignore[no-untyped-def]
    cfg = tiny_config(tmp_path, "rollout.num_workers=1", "rollout.group_size=4",
                      "trainer.groups_per_step=2", "trainer.checkpoint_every=0",
                      "trainer.batch_timeout_s=120", *overrides)  # fmt: skip
    cfg.reward = RewardConfig.model_validate({"functions": functions, "workers": 2,
                                              "retries": 1, "max_consecutive_failures": 4})  # fmt: skip
    controller = Controller(cfg, cfg.model.init_from, evaluate=False)
    trained: list = []
    real_step = controller.trainer.step

    def step(batch):  # type: ignore[no-untyped-def]
        trained.extend(batch.samples)
        return real_step(batch)

    controller.trainer.step = step  # type: ignore[method-assign]
    launcher = LocalLauncher(cfg, controller.coord)
    launcher.start()
    return controller, launcher, trained


@pytest.mark.slow  # ~25 s on 2 busy cores, like the other job tests of test_rl_loop.py
def test_trained_rewards_are_the_weighted_sum_and_logged_per_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYTHONPATH", TESTS)  # the workers (and their reward processes) import it
    controller, launcher, trained = run_job(tmp_path, FUNCTIONS, "trainer.steps=3")
    try:
        result = controller.run()
    finally:
        launcher.stop()
    assert result.steps == 3 and len(trained) == 3 * 2 * 4
    for s in trained:
        assert set(s.reward_components) == set(WEIGHTS)
        assert s.reward_components["na"] is None
        want = sum(WEIGHTS[k] * v for k, v in s.reward_components.items() if v is not None)
        assert s.reward == pytest.approx(want)
        assert s.reward_components["len"] == pytest.approx(1 / (1 + len(s.text)))
    for rec in (r for r in result.records if "loss" in r):
        for name in WEIGHTS:
            assert f"reward/{name}/mean" in rec and f"reward/{name}/none" in rec
        assert rec["reward/na/none"] == 1.0 and rec["reward/len/none"] == 0.0
        assert rec["reward/len/failed_calls"] == 0.0


@pytest.mark.slow
def test_a_function_that_keeps_failing_stops_the_job_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYTHONPATH", TESTS)
    bad = [{"name": "verifier", "kind": "verifier"},
           {"name": "bad", "kind": "python", "function": "reward_fns:raises"}]  # fmt: skip
    controller, launcher, trained = run_job(tmp_path, bad, "trainer.steps=50")
    try:
        with pytest.raises(RolloutFailed) as err:
            controller.run()
    finally:
        launcher.stop()
    # at least the bound: calls already in flight when the 4th failed may fail too and count
    m = re.fullmatch(r"reward function 'bad' failed on (\d+) consecutive calls "
                     r"\(reward.max_consecutive_failures\); last: ZeroDivisionError: "
                     r"the user's bug", str(err.value))  # fmt: skip
    assert m is not None and int(m.group(1)) >= 4, str(err.value)
    assert trained == []  # no group was ever rewarded by the failing function
    assert controller.coord.status().dropped_tasks >= 1
