"""verifiers 0.4 environments (examples/verifiers/) run unchanged as agent episodes: the agent
program `python -m slipstream.envs.verifiers_env run` drives a real verifiers `Env` (the `null`
harness in verifiers' subprocess runtime) against the episode endpoint; the scripted engine
answers, so the cases are exact. The episode's reward is verifiers' weighted sum, passed through
a real RewardSet (`episode_reward`); its samples carry the ids the engine sampled.

Needs the `verifiers` extra (verifiers pins openai<3, so it is not in `dev`; docs/verifiers.md)
and `uv` (the null harness is a PEP 723 script): skipped without them."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest

from agentutil import TOK, ScriptedEngine
from slipstream.config import load_config
from slipstream.config.agent import AgentConfig
from slipstream.config.rm import RewardConfig
from slipstream.envs import EpisodeLimits
from slipstream.envs.agent import AgentRuntime
from slipstream.envs.verifiers_env import main as vf_main
from slipstream.rewards.pool import RewardPool
from slipstream.rewards.rewardset import RewardSet
from slipstream.tasks import Task

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "verifiers"
# uv checks PyPI for the harness program's packages; the agent's environment is cleared
TLS_ENV = {k: os.environ[k] for k in ("SSL_CERT_FILE", "SSL_CERT_DIR") if k in os.environ}
UV_CACHE = Path(os.environ.get("UV_CACHE_DIR", Path.home() / ".cache" / "uv"))

needs_verifiers = pytest.mark.skipif(
    importlib.util.find_spec("verifiers") is None
    or shutil.which("uv", path=f"{Path(sys.executable).parent}:{os.environ['PATH']}") is None,
    reason="needs the `verifiers` extra (verifiers 0.4 and uv: its null harness is a uv script)",
)


class _TaskSet:
    tokenizer = TOK


@pytest.fixture(scope="module")
def rewards():  # type: ignore[no-untyped-def]
    pool = RewardPool(1, 1 << 30)
    fns = [{"name": "verifiers", "kind": "python", "batched": False,
            "function": "slipstream.envs.verifiers_env:episode_reward"}]  # fmt: skip
    rs = RewardSet(RewardConfig.model_validate({"functions": fns}), pool=pool)
    yield rs
    rs.close()
    pool.close()


@pytest.fixture(scope="module")
def tasks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("vf") / "vf_retry.jsonl"
    assert vf_main(["export", "--taskset", "vf_retry", "--env", "vf_retry",
                    "--path", str(EXAMPLES), "--out", str(out), "--limit", "3"]) == 0  # fmt: skip
    return [json.loads(line) for line in out.read_text().splitlines()]


def run(replies: list[str], row: dict[str, Any], rewards: RewardSet, env: str) -> Any:
    """One agent episode of `row` in verifiers env `env`; the engine answers call k with
    replies[k] + EOS."""
    args = {"": "--taskset vf_arith", "vf_calc": "--taskset vf_calc"}.get(
        env, f"--taskset vf_retry --env {env}"
    )
    cfg = AgentConfig(command=f"{{python}} -m slipstream.envs.verifiers_env run {args} "
                              f"--path {EXAMPLES} --uv-cache {UV_CACHE}",
                      memory_mib=8192, max_output_bytes=1 << 30, timeout_s=120,
                      env=TLS_ENV)  # fmt: skip
    engine = ScriptedEngine([TOK.encode(r) + [TOK.eos_id] for r in replies])
    rt = AgentRuntime(engine, _TaskSet(), cfg, EpisodeLimits(max_turns=4, max_turn_tokens=128),  # type: ignore[arg-type]
                      scorer=rewards.verify)  # fmt: skip
    cols = {k: v for k, v in row.items() if k != "prompt"}
    task = Task("dataset/train/0", row["prompt"], row["prompt"],
                {"prompt": row["prompt"], "answer": row["answer"], "columns": cols})  # fmt: skip
    try:
        session = rt.endpoint.open(max_calls=4, max_sampled_tokens=256)
        result = rt.run_agent(task, session, lambda: False)
        assert result.exit_code == 0, result.stderr[-3000:]
        return result, rt.episodes(task, result, session), engine
    finally:
        rt.close()


@pytest.mark.slow
@needs_verifiers
@pytest.mark.parametrize(("reply", "reward"), [("right", 1.0), ("short", 0.2), ("long", 0.0)])
def test_single_turn_reward_is_the_rubrics_weighted_sum(
    tasks: list[dict[str, Any]], rewards: RewardSet, reply: str, reward: float
) -> None:
    row = tasks[0]
    answer = row["answer"]
    text = {"right": answer, "short": answer[:-1], "long": answer + "0"}[reply]
    result, eps, engine = run([text], row, rewards, env="")
    # vf_arith: 0.8 * correct + 0.2 * concise, as verifiers scored it
    scores = {k: v["score"] for k, v in result.output["rewards"].items()}
    weights = {k: v["weight"] for k, v in result.output["rewards"].items()}
    assert weights == {"correct": 0.8, "concise": 0.2}
    assert scores == {"correct": float(reply == "right"), "concise": float(reply != "long")}
    (ep,) = eps
    assert ep.reward == pytest.approx(reward) and ep.reward_components == {"verifiers": ep.reward}
    # token-exact: the prompt as the engine was fed it, the ids it sampled, its logprobs
    assert ep.prompt_ids == TOK.chat_prompt([{"role": "user", "content": row["prompt"]}])
    assert ep.completion_ids == TOK.encode(text) + [TOK.eos_id] and ep.loss_mask == [1] * len(
        ep.completion_ids
    )
    assert ep.logprobs == [-0.1] * len(ep.completion_ids)
    assert [r.prompt_ids for r in engine.requests] == [ep.prompt_ids]


@pytest.mark.slow
@needs_verifiers
def test_multi_turn_env_is_one_token_exact_sample(
    tasks: list[dict[str, Any]], rewards: RewardSet
) -> None:
    row = tasks[1]
    answer = row["answer"]
    wrong = str(int(answer) + 1)
    result, eps, engine = run([wrong, answer], row, rewards, env="vf_retry")
    assert result.output["turns"] == 2 and result.output["last_reply"] == answer
    # correct 1 * 0.8 + concise 1 * 0.2 + first_try 0 * 0.5
    (ep,) = eps
    assert ep.reward == pytest.approx(1.0) and ep.num_turns == 2
    a, b = TOK.encode(wrong) + [TOK.eos_id], TOK.encode(answer) + [TOK.eos_id]
    obs = TOK.encode("no, again:")  # RetryEnv's user turn: observed, not trained on
    assert ep.completion_ids == a + obs + b
    assert ep.loss_mask == [1] * len(a) + [0] * len(obs) + [1] * len(b)
    assert ep.logprobs == [-0.1] * len(a) + [-0.2] * len(b)
    assert engine.requests[1].prompt_ids == ep.prompt_ids + a + obs


@pytest.mark.slow
@needs_verifiers
def test_first_try_bonus_counts(tasks: list[dict[str, Any]], rewards: RewardSet) -> None:
    row = tasks[2]
    result, (ep,), _ = run([row["answer"]], row, rewards, env="vf_retry")
    assert result.output["turns"] == 1
    assert ep.reward == pytest.approx(0.8 + 0.2 + 0.5)


@pytest.mark.slow
@needs_verifiers
def test_tool_env_runs_the_models_tool_call(
    tasks: list[dict[str, Any]], rewards: RewardSet
) -> None:
    """vf_calc: the model's Hermes tool call reaches verifiers' MCP tool server; its result is
    the next call's observation. The char template renders no tool calls, so the second call's
    prompt does not extend the first call's sequence: two samples, each token-exact, one reward."""
    row = tasks[0]  # vf_calc's tasks are vf_arith's (and vf_retry's): same idx, same prompt
    a, b = (int(x) for x in row["prompt"].rstrip("=").split("*"))
    call = json.dumps({"name": "calc_toolset_multiply", "arguments": {"a": a, "b": b}})
    calc_row = {**row, "vf_key": _key("vf_calc", row["vf_idx"])}
    result, eps, engine = run([f"<tool_call>{call}</tool_call>", row["answer"]], calc_row,
                              rewards, env="vf_calc")  # fmt: skip
    assert result.output["turns"] == 2 and result.output["rewards"]["used_tool"]["score"] == 1.0
    first, second = eps
    assert first.completion_ids == TOK.encode(f"<tool_call>{call}</tool_call>") + [TOK.eos_id]
    # the tool's output ("198"), rendered after the assistant turn the template left empty
    assert second.prompt_ids == first.prompt_ids + [TOK.eos_id] + TOK.encode(row["answer"])
    assert second.completion_ids == TOK.encode(row["answer"]) + [TOK.eos_id]
    assert [r.prompt_ids for r in engine.requests] == [first.prompt_ids, second.prompt_ids]
    assert first.reward == second.reward == pytest.approx(0.8 + 0.2 + 0.1)


def _key(taskset: str, idx: int) -> str:
    from slipstream.envs.verifiers_env import env_config, task_at

    sys.path.insert(0, str(EXAMPLES))
    try:
        import verifiers.v1 as vf

        return task_at(vf.load_environment(env_config(taskset)), idx).key
    finally:
        sys.path.remove(str(EXAMPLES))


def test_example_config_loads() -> None:
    cfg = load_config(EXAMPLES / "train.toml")
    assert cfg.task.env == "agent" and "slipstream.envs.verifiers_env run" in cfg.agent.command
    assert cfg.agent.preload == ["verifiers.v1"]
    assert [f.function for f in cfg.reward.functions] == [
        "slipstream.envs.verifiers_env:episode_reward"
    ]


def test_episode_reward_is_the_reported_one_and_refuses_none() -> None:
    """Runs without verifiers: the reward function reads the agent's report, never makes one up."""
    from slipstream.envs.verifiers_env import episode_reward

    assert episode_reward("p", "c", agent_output={"reward": 0.2, "rewards": {}}) == 0.2
    for bad in (None, {}, {"reward": "1"}, [0.2]):
        with pytest.raises(ValueError, match="no verifiers reward"):
            episode_reward("p", "c", agent_output=bad)
