"""What `python` reward functions receive for an agent episode: `messages` (the final
conversation) and `agent_output` (the agent's parsed result), as keyword arguments like
columns. A real agent process talks to the episode endpoint (the scripted engine answers "408"),
`AgentRuntime.episodes` scores it through a real RewardSet and reward processes; the functions
are in tests/reward_fns.py."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import pytest

from agentutil import TOK, ScriptedEngine
from slipstream.config.agent import AgentConfig
from slipstream.config.rm import RewardConfig
from slipstream.envs import EpisodeLimits, EpisodeRunner, run_episodes
from slipstream.envs.agent import AgentRuntime
from slipstream.envs.agent_trajectory import REWARD_INPUTS_KEY
from slipstream.rewards.pool import RewardPool
from slipstream.rewards.rewardset import RewardSet, group_reward_inputs, reward_inputs
from slipstream.tasks import Task

TASK = Task("t/0", "12*34=", "12*34=", {"answer": 408})

# two chat calls (the second appends the reply and "sure?"), then the answer it claims:
# argv[1] = "file" (result.json), "stdout" (stdout JSON) or "none" (no output); argv[2] = the
# offset, or claim:DIR (each agent of a group claims its own: 0, 1, 2, ...)
AGENT = textwrap.dedent("""\
    import json, os, sys, urllib.request
    task = json.load(sys.stdin)
    def chat(messages):
        req = urllib.request.Request(
            os.environ["OPENAI_BASE_URL"] + "/chat/completions",
            data=json.dumps({"model": os.environ["OPENAI_MODEL"], "messages": messages}).encode(),
            headers={"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"],
                     "Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=10) as r:
            return json.load(r)["choices"][0]["message"]
    msgs = [{"role": "user", "content": task["prompt"]}]
    msgs += [chat(msgs), {"role": "user", "content": "sure?"}]
    reply = chat(msgs)
    offset = sys.argv[2]
    if offset.startswith("claim:"):  # the first free index under that directory: 0, 1, 2, ...
        for i in range(100):
            try:
                os.mkdir(os.path.join(offset[6:], str(i)))
                break
            except FileExistsError:
                pass
        offset = i
    claim = {"answer": int(reply["content"]) + int(offset)}
    if sys.argv[1] == "file":
        with open("result.json", "w") as f:
            json.dump(claim, f)
    elif sys.argv[1] == "stdout":
        print(json.dumps(claim))
""")


class _TaskSet:
    tokenizer = TOK

    def prompt_ids(self, task: Task) -> list[int]:
        return TOK.chat_prompt([{"role": "user", "content": task.prompt}])


@pytest.fixture(scope="module")
def rewards():  # type: ignore[no-untyped-def]
    pool = RewardPool(1, 1 << 30)
    fns = [{"name": n, "kind": "python", "function": f"reward_fns:{n}"}
           for n in ("agent_answer", "conversation_length", "last_user_turn")]  # fmt: skip
    rs = RewardSet(RewardConfig.model_validate({"functions": fns}), pool=pool)
    yield rs
    rs.close()
    pool.close()


def episode(tmp_path: Path, rewards: RewardSet, how: str, offset: int) -> Any:
    script = tmp_path / "agent.py"
    script.write_text(AGENT)
    cfg = AgentConfig(command=f"{{python}} {script} {how} {offset}")
    rt = AgentRuntime(ScriptedEngine([TOK.encode("408") + [TOK.eos_id]]), _TaskSet(), cfg,  # type: ignore[arg-type]
                      EpisodeLimits(max_turns=4, max_turn_tokens=8),
                      scorer=rewards.verify)  # fmt: skip
    try:
        session = rt.endpoint.open(max_calls=4, max_sampled_tokens=64)
        run = rt.run_agent(TASK, session, lambda: False)
        assert run.exit_code == 0, run.stderr
        return run, rt.episodes(TASK, run, session)
    finally:
        rt.close()


@pytest.mark.parametrize(("how", "offset", "right"),
                         [("file", 0, 1.0), ("stdout", 0, 1.0), ("file", 1, 0.0),
                          ("none", 0, 0.0)])  # fmt: skip
def test_reward_functions_get_the_episodes_messages_and_output(
    tmp_path: Path, rewards: RewardSet, how: str, offset: int, right: float
) -> None:
    run, eps = episode(tmp_path, rewards, how, offset)
    assert run.output == (None if how == "none" else {"answer": 408 + offset})
    assert len(run.calls) == 2 and eps
    for ep in eps:  # every sample of the episode has the episode's components
        # user, assistant, user "sure?", the last reply: 4 messages
        assert ep.reward_components == {"agent_answer": right, "conversation_length": 4.0,
                                        "last_user_turn": 1.0}  # fmt: skip
        assert ep.reward == right + 4.0 + 1.0


def test_other_tasks_pass_neither_and_a_clashing_column_is_refused() -> None:
    _, columns = reward_inputs(TASK)
    assert columns == {"answer": 408}  # a built-in task: unchanged
    extra = {"messages": None, "agent_output": {"answer": 1}}
    _, columns = reward_inputs(Task("t/1", "p", "p", {"answer": 3, REWARD_INPUTS_KEY: extra}))
    assert columns == {"answer": 3, **extra}
    custom = Task("t/2", "p", "p", {"columns": {"messages": [], "x": 1}, REWARD_INPUTS_KEY: extra})
    with pytest.raises(ValueError, match=r"t/2: column\(s\) \['messages'\] clash"):
        reward_inputs(custom)


def test_group_functions_get_each_episodes_output_and_messages_in_group_order(
    tmp_path: Path,
) -> None:
    """A group of 3 agent episodes run by the episode loop: the group function scores each
    episode from the group's `agent_output` and `messages` lists, entry i being episode i's
    (each agent claims its own offset 0/1/2: its score is that offset, the one in its output)."""
    from concurrent.futures import ThreadPoolExecutor

    script = tmp_path / "agent.py"
    script.write_text(AGENT)
    (tmp_path / "claims").mkdir()
    fn = {"name": "above_low", "kind": "python", "function": "agent_group_fns:claim_above_group_low",
          "group": True}  # fmt: skip
    pool = RewardPool(1, 1 << 30)
    rs = RewardSet(RewardConfig.model_validate({"functions": [fn]}), pool=pool)
    cfg = AgentConfig(command=f"{{python}} {script} file claim:{tmp_path / 'claims'}")
    limits = EpisodeLimits(max_turns=4, max_turn_tokens=8)
    engine = ScriptedEngine([TOK.encode("408") + [TOK.eos_id]])
    rt = AgentRuntime(engine, _TaskSet(), cfg, limits, scorer=rs.verify)  # type: ignore[arg-type]
    steps = ThreadPoolExecutor(3)
    runner = EpisodeRunner(engine, rt.factory(), TOK, limits, steps,  # type: ignore[arg-type]
                           group_scorer=rs.score_group)  # fmt: skip
    try:
        (out,) = run_episodes(runner, [TASK], 3, timeout_s=60)
    finally:
        runner.close()
        rt.close()
        steps.shutdown()
        rs.close()
        pool.close()
    assert out.status == "done" and len(out.episodes) == 3, out.error
    for ep in out.episodes:
        assert ep.reward_inputs is not None and len(ep.reward_inputs["messages"]) == 4
        mine = ep.reward_inputs["agent_output"]["answer"] - 408
        assert ep.reward_components == {"above_low": float(mine)}
    assert sorted(ep.reward for ep in out.episodes) == [0.0, 1.0, 2.0]


def test_group_inputs_must_be_one_per_completion() -> None:
    extra = {"messages": [None, None], "agent_output": [{"answer": 1}, None]}
    task = Task("t/3", "p", "p", {"answer": 3, REWARD_INPUTS_KEY: extra})
    _, columns, per = group_reward_inputs(task, 2)
    assert columns == {"answer": 3} and per == extra  # lists as they are, not columns
    with pytest.raises(ValueError, match=r"t/3: .* 'agent_output' is not a list of the group's 3"):
        group_reward_inputs(Task("t/3", "p", "p", {REWARD_INPUTS_KEY: {"agent_output": [1, 2]}}), 3)
