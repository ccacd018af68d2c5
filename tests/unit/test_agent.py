"""The episode endpoint and token-exact trajectories, with a scripted engine (it answers each call
with the ids the test chose, so the cases are exact): calls merge into one sample only when the
prompt extends the previous prompt + completion, sampled ids reach the sample as sampled (a
re-tokenising implementation fails here), refusals are counted and never recorded, and GRPO's
baseline counts an episode of several samples once."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
import torch

from agentutil import TOK, ScriptedEngine
from slipstream.engine.base import Completion
from slipstream.envs.agent_endpoint import AgentEndpoint
from slipstream.envs.agent_trajectory import segments

HTTP = httpx.Client(timeout=10)  # one connection pool: a fresh one per request costs ~0.1 s


@pytest.fixture
def endpoint():  # type: ignore[no-untyped-def]
    ep = AgentEndpoint(ScriptedEngine([TOK.encode("42") + [TOK.eos_id]]), TOK, max_turn_tokens=16)
    yield ep
    ep.close()


def chat(session: Any, messages: list[dict[str, Any]], **extra: Any) -> httpx.Response:
    return HTTP.post(f"{session.base_url}/chat/completions", timeout=10,
                      headers={"Authorization": f"Bearer {session.api_key}"},
                      json={"model": "policy", "messages": messages, **extra})  # fmt: skip


def test_appended_history_is_one_sample_and_sampled_ids_are_kept(endpoint) -> None:  # type: ignore[no-untyped-def]
    # call 1 samples "4", BOS, "2", EOS: its text "42" renders back without the BOS, so a
    # sample rebuilt from the chat text would train on ids the engine never sampled
    odd = [TOK.encode("4")[0], TOK.bos_id, TOK.encode("2")[0], TOK.eos_id]
    plain = TOK.encode("17") + [TOK.eos_id]
    endpoint.engine.replies = [plain, odd, plain]
    s = endpoint.open(max_calls=8, max_sampled_tokens=100)
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "3+4="}]
    for _ in range(3):
        r = chat(s, msgs)
        assert r.status_code == 200, r.text
        msgs += [r.json()["choices"][0]["message"], {"role": "user", "content": " again:"}]
    assert [c.completion.token_ids for c in s.calls] == [plain, odd, plain]
    segs = segments([(c.prompt_ids, c.completion) for c in s.calls])
    # call 2 extends call 1 (one sample); call 3's prompt holds "42" without the BOS: new sample
    assert len(segs) == 2 and [g.num_calls for g in segs] == [2, 1]
    first = segs[0]
    assert first.prompt_ids == TOK.chat_prompt([{"role": "user", "content": "3+4="}])
    sampled = [t for t, m in zip(first.completion_ids, first.loss_mask, strict=True) if m]
    assert sampled == plain + odd  # the BOS the engine sampled is trained on, as sampled
    assert first.logprobs == [-0.1] * 3 + [-0.2] * 4 and first.versions == [7] * 7
    observed = [t for t, m in zip(first.completion_ids, first.loss_mask, strict=True) if not m]
    assert TOK.decode(observed) == " again:"
    assert (
        TOK.chat_prompt(msgs[:5])[: len(first.sequence)] != first.sequence
    )  # re-tokenised text differs


def test_segments_stitch_routing_like_the_episode_loop() -> None:
    def comp(prompt: list[int], ids: list[int], base: int) -> Completion:
        rows = len(prompt) + len(ids) - 1
        r = torch.arange(base, base + rows, dtype=torch.uint8).view(rows, 1, 1)
        return Completion("r", 0, prompt, ids, "", [0.0] * len(ids), "stop", [1] * len(ids),
                          routed_experts=r)  # fmt: skip

    p1 = [1, 5, 6]
    c1 = comp(p1, [7, 8], 0)
    p2 = p1 + [7, 8] + [9]
    c2 = comp(p2, [10], 100)
    (seg,) = segments([(p1, c1), (p2, c2)])
    r = seg.routed_experts().flatten().tolist()
    assert len(r) == len(seg.sequence) - 1
    # rows 0..3 from call 1 (prompt + its first sampled token), the rest from call 2
    assert r == [0, 1, 2, 3, 104, 105]
    assert seg.loss_mask == [1, 1, 0, 1]


def test_refusals_are_answered_counted_and_never_recorded(endpoint) -> None:  # type: ignore[no-untyped-def]
    s = endpoint.open(max_calls=2, max_sampled_tokens=100)
    other = endpoint.open(max_calls=2, max_sampled_tokens=100)
    user = [{"role": "user", "content": "1+1="}]
    url = f"{s.base_url}/chat/completions"
    auth = {"Authorization": f"Bearer {s.api_key}"}
    assert HTTP.post(url, json={"messages": user}).status_code == 401
    wrong = {"Authorization": f"Bearer {other.api_key}"}
    assert HTTP.post(url, json={"messages": user}, headers=wrong).status_code == 401
    gone = url.replace(s.id, "0" * 32)
    assert HTTP.post(gone, json={"messages": user}, headers=auth).status_code == 404
    bad = [
        HTTP.post(url, content=b"{not json", headers={**auth, "Content-Type": "application/json"}),
        HTTP.post(url, json={"messages": []}, headers=auth),
        HTTP.post(url, json={"messages": user, "n": 2}, headers=auth),
        HTTP.post(url, json={"messages": user, "no_such_field": 1}, headers=auth),
        HTTP.post(url, json={"messages": user, "tool_choice": "required"}, headers=auth),
        HTTP.post(url, json={"messages": [{"role": "user", "content": 5}]}, headers=auth),
    ]
    for r in bad:
        assert r.status_code == 400, r.text
        assert r.json()["error"]["message"]
    assert s.bad_requests == len(bad) and s.calls == []
    assert chat(s, user).status_code == 200
    assert chat(s, user).status_code == 200
    r = chat(s, user)
    assert r.status_code == 403 and "limit of 2 model calls" in r.json()["error"]["message"]
    assert len(s.calls) == 2 and s.refused == 1
    s.close()
    assert chat(s, user).status_code == 404  # the episode ended: its URL is gone
    other.close()


def test_token_budget_caps_and_refuses(endpoint) -> None:  # type: ignore[no-untyped-def]
    s = endpoint.open(max_calls=10, max_sampled_tokens=4)
    user = [{"role": "user", "content": "1+1="}]
    r = chat(s, user, max_tokens=50, temperature=0.01, top_p=0.5)
    assert r.status_code == 200
    req = endpoint.engine.requests[-1]
    assert req.params.max_new_tokens == 4  # min(asked, turn cap, budget left)
    assert req.params.temperature == 1.0 and req.params.top_p == 1.0  # the run's sampling
    assert chat(s, user).status_code == 200  # 3 sampled ("42" + EOS), 1 left
    assert endpoint.engine.requests[-1].params.max_new_tokens == 1
    assert chat(s, user).status_code == 403
    s.close()


def test_streaming_and_completions_match_the_record(endpoint) -> None:  # type: ignore[no-untyped-def]
    s = endpoint.open(max_calls=4, max_sampled_tokens=100)
    user = [{"role": "user", "content": "1+1="}]
    with HTTP.stream("POST", f"{s.base_url}/chat/completions", timeout=10,
                      headers={"Authorization": f"Bearer {s.api_key}"},
                      json={"messages": user, "stream": True,
                            "stream_options": {"include_usage": True}}) as r:  # fmt: skip
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == s.calls[0].completion.text == "42"
    assert chunks[-1]["usage"]["completion_tokens"] == 3
    r = HTTP.post(f"{s.base_url}/completions", timeout=10,
                   headers={"Authorization": f"Bearer {s.api_key}"},
                   json={"prompt": "9+9=", "logprobs": 0})  # fmt: skip
    assert r.status_code == 200, r.text
    body = r.json()["choices"][0]
    assert body["token_ids"] == s.calls[1].completion.token_ids
    assert body["logprobs"]["token_logprobs"] == s.calls[1].completion.logprobs
    assert s.calls[1].prompt_ids == TOK.encode_prompt("9+9=")
    s.close()


def test_grpo_baseline_counts_an_episode_once() -> None:
    from slipstream.config.rl import TrainerConfig
    from slipstream.rl.trainer import Trainer
    from slipstream.rl.types import Group, Sample, TaskRef

    def sample(reward: float, episode: int = -1) -> Sample:
        return Sample([1, 2], [3], [0.0], [0], reward=reward, episode=episode)

    # episode 0 (reward 1) gave three samples, episode 1 (reward 0) one: over episodes the
    # advantages are +1 / -1; counting samples would have made them +0.58 / -1.73
    split = Group(TaskRef(0, 0), [sample(1, 0), sample(1, 0), sample(1, 0), sample(0, 1)])
    plain = Group(TaskRef(1, 1), [sample(1), sample(0)])
    t = {"behaviour_BT": torch.zeros(6, 1)}
    trainer = Trainer.__new__(Trainer)
    trainer.cfg, trainer.device = TrainerConfig(), torch.device("cpu")
    adv, _ = trainer._advantages([split, plain], t)
    assert adv[:, 0].tolist() == pytest.approx([1, 1, 1, -1, 1, -1], abs=1e-4)


def test_an_agent_episodes_samples_share_group_rewards() -> None:
    """The episode loop runs an AgentDriven environment on its own thread; a group reward
    function's score reaches every sample of a split episode; a failed run is re-run."""
    from concurrent.futures import ThreadPoolExecutor

    from slipstream.envs import EnvUsage, EpisodeLimits, EpisodeRunner, InfraError, run_episodes
    from slipstream.envs.base import Score
    from slipstream.envs.episode import Episode
    from slipstream.tasks import Task

    class Driven:
        stop: tuple[str, ...] = ()
        runs = 0

        def __init__(self) -> None:
            self.usage = EnvUsage()

        def reset(self, task: Task) -> list[int]:
            return [1]

        def run(self, task: Task, stopped: Any) -> list[Episode]:
            Driven.runs += 1
            if Driven.runs == 1:
                raise InfraError("the first run fails")
            return [Episode([1, 5], [6], [1], [-0.5], [0], reward=1.0, text="a"),
                    Episode([1, 7], [8], [1], [-0.5], [0], reward=1.0, text="b")]  # fmt: skip

        def close(self) -> None:
            pass

    def group(task: Task, texts: list[str]) -> list[Score]:
        assert texts == ["a", "a"]  # one text per episode
        return [Score(0.5, "group", {"g": 0.5})] * len(texts)

    with ThreadPoolExecutor(2) as pool:
        runner = EpisodeRunner(None, Driven, TOK, EpisodeLimits(), pool, group_scorer=group)  # type: ignore[arg-type]
        (out,) = run_episodes(runner, [Task("t/0", "1+1=", "k")], n=2, timeout_s=30)
        runner.close()
    assert out.status == "done" and out.infra_failures == 1
    assert len(out.episodes) == 4
    assert [e.reward for e in out.episodes] == [1.5] * 4
    assert all(e.reward_components == {"g": 0.5} for e in out.episodes)
    assert sorted(e.episode_index for e in out.episodes) == [0, 0, 1, 1]
    assert all(e.infra_retries in (0, 1) for e in out.episodes)


def test_parse_tool_calls_hermes_format() -> None:
    from slipstream.envs.agent_endpoint import parse_tool_calls

    text = 'ok <tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call><tool_call>{"name": "b", "arguments": "{}"}</tool_call>'
    content, calls = parse_tool_calls(text)
    assert content == "ok" and [c["function"]["name"] for c in calls] == ["a", "b"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"x": 1}
    assert calls[1]["function"]["arguments"] == "{}" and calls[0]["id"] != calls[1]["id"]
    for bad in ["<tool_call>{not json}</tool_call>", '<tool_call>{"arguments": {}}</tool_call>',
                "<tool_call>[1]</tool_call>", "no call"]:  # fmt: skip
        assert parse_tool_calls(bad) == (bad, [])  # the text stays the content
