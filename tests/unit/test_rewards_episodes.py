"""Group reward functions inside the one episode loop (real native engine, real reward processes):
their scores add to each episode's reward and components; a group function that gives no reward
drops the group (status `dropped`, counted), never rewards it; a fatal one says so."""

from __future__ import annotations

import pytest
from test_envs import run_group, setup  # noqa: F401 - the module's engine fixture

from slipstream.config.rm import RewardConfig
from slipstream.envs import EpisodeLimits, EpisodeRunner, make_env_factory
from slipstream.envs.single_turn import taskset_scorer
from slipstream.rewards.rewardset import RewardSet


def runner_with(setup, functions, **cfg):  # type: ignore[no-untyped-def] # noqa: F811
    ts, engine, pool = setup
    rc = RewardConfig.model_validate({"functions": functions, "workers": 1, **cfg})
    rs = RewardSet(rc, {"verifier": taskset_scorer(ts)})
    limits = EpisodeLimits(max_turn_tokens=5)
    runner = EpisodeRunner(engine, make_env_factory(ts, scorer=rs.verify, limits=limits),
                           ts.tokenizer, limits, pool, context_tokens=engine.max_seq_len,
                           group_scorer=rs.score_group)  # fmt: skip
    return ts, rs, runner


def test_group_scores_add_to_rewards_and_failures_drop_the_group(setup) -> None:  # type: ignore[no-untyped-def] # noqa: F811
    ts, rs, runner = runner_with(setup, [
        {"name": "verifier", "kind": "verifier", "weight": 0.5},
        {"name": "short", "kind": "python", "function": "reward_fns:rank_in_group",
         "group": True, "weight": 2.0}])  # fmt: skip
    try:
        out = run_group(runner, ts.train(1), n=4)
        assert out.status == "done"
        lens = [len(ep.text) for ep in out.episodes]
        for ep, n in zip(out.episodes, lens, strict=True):
            assert ep.reward_components["short"] == float(n == min(lens))
            v = ep.reward_components["verifier"]
            assert ep.reward == pytest.approx(0.5 * v + 2.0 * ep.reward_components["short"])
    finally:
        rs.close()
    ts, rs, runner = runner_with(setup, [
        {"name": "verifier", "kind": "verifier"},
        {"name": "bad", "kind": "python", "function": "reward_fns:wrong_length", "group": True}],
        retries=1, max_consecutive_failures=2)  # fmt: skip
    try:
        out = run_group(runner, ts.train(2), n=4)
        assert out.status == "dropped" and out.episodes == []
        assert out.error == out.fatal
        assert out.fatal == ("reward function 'bad' failed on 2 consecutive calls "
                             "(reward.max_consecutive_failures); last: returned 5 rewards for "
                             "4 completions")  # fmt: skip
    finally:
        rs.close()


def test_per_sample_failure_drops_the_group_without_rerunning(setup) -> None:  # type: ignore[no-untyped-def] # noqa: F811
    ts, rs, runner = runner_with(
        setup, [{"name": "nan", "kind": "python", "function": "reward_fns:returns_nan"}], retries=0
    )
    try:
        out = run_group(runner, ts.train(3), n=4)
        assert out.status == "dropped" and out.episodes == [] and not out.fatal
        assert out.requests == 1  # one group request: no episode was re-generated
        assert rs.reward_stats()["reward_nan_scores"] == 0
    finally:
        rs.close()
