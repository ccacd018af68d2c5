"""Agents as processes (task.env = "agent"): real agent programs (an `openai`-SDK script, a curl
shell script, broken ones) run per episode against the worker's episode endpoint, backed by the
real native engine with a tiny random model; the episodes go through the one episode loop, the
worker's Sample conversion, collate and a real trainer step. What the trainer receives is
compared with what the engine recorded, id for id."""

from __future__ import annotations

import json
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

from agentutil import TOK, ScriptedEngine
from slipstream.config import load_config
from slipstream.config.agent import AgentConfig
from slipstream.engine import NativeEngine
from slipstream.envs import EpisodeLimits, EpisodeRunner, run_episodes
from slipstream.envs.agent import AgentRuntime
from slipstream.envs.agent_endpoint import AgentEndpoint
from slipstream.model import MoEForCausalLM
from slipstream.rl.trainer import Trainer, collate
from slipstream.rl.types import Batch, Group, TaskRef
from slipstream.rl.worker import episode_sample
from slipstream.tasks import get_taskset

ROOT = Path(__file__).resolve().parents[2]
AGENTS = ROOT / "examples" / "agents"
TINY = ["model.hidden_size=32", "model.num_hidden_layers=1", "model.num_attention_heads=2",
        "model.num_key_value_heads=1", "model.head_dim=16", "model.moe_intermediate_size=32",
        "model.num_experts=4", "model.num_experts_per_tok=2", "model.vocab_size=99",
        "model.max_position_embeddings=96"]  # fmt: skip


class Recording:
    """The real engine, its requests and completions recorded on the way through."""

    def __init__(self, engine: NativeEngine) -> None:
        self.engine = engine
        self.calls: list[tuple[list[int], Any]] = []
        self.lock = threading.Lock()

    @property
    def version(self) -> int:
        return self.engine.version

    def submit(self, request):  # type: ignore[no-untyped-def]
        fut = self.engine.submit(request)

        def record(f):  # type: ignore[no-untyped-def]
            if f.exception() is None:
                with self.lock:
                    self.calls.extend((list(request.prompt_ids), c) for c in f.result())

        fut.add_done_callback(record)
        return fut

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)


@pytest.fixture(scope="module")
def setup():  # type: ignore[no-untyped-def]
    cfg = load_config(None, TINY)
    ts = get_taskset(cfg.task)
    torch.manual_seed(0)
    model = MoEForCausalLM(cfg.model)
    engine = NativeEngine(model, cfg.engine.model_copy(update={"max_batch_size": 16,
                          "kv_cache_tokens": 16 * 96}), tokenizer=ts.tokenizer)  # fmt: skip
    pool = ThreadPoolExecutor(4)
    yield cfg, ts, engine, model, pool
    engine.close()
    pool.shutdown()


def run_agent(setup, command: str, n: int = 2, *, env: dict[str, str] | None = None,  # type: ignore[no-untyped-def]
              record_routing: bool = True, retries: int = 0, **agent: Any):  # fmt: skip
    cfg, ts, engine, _, pool = setup
    rec = Recording(engine)
    limits = EpisodeLimits(max_turns=4, max_turn_tokens=8, max_infra_retries=retries)
    acfg = AgentConfig(command=command, env=env or {}, **agent)
    rt = AgentRuntime(rec, ts, acfg, limits, temperature=1.0,  # type: ignore[arg-type]
                      record_routing=record_routing, context_tokens=engine.max_seq_len)  # fmt: skip
    runner = EpisodeRunner(rec, rt.factory(), ts.tokenizer, limits, pool,  # type: ignore[arg-type]
                           record_routing=record_routing, context_tokens=engine.max_seq_len)  # fmt: skip
    try:
        (out,) = run_episodes(runner, [ts.train(0)], n, seed=3, timeout_s=60)
    finally:
        runner.close()
        rt.close()
    return out, rec, rt


def check_exact(out, rec) -> None:  # type: ignore[no-untyped-def]
    """Every sample's sampled ids, logprobs, versions and routing are the engine's records: the
    sample is rebuilt from the engine's calls alone (each call's prompt is the sample's sequence
    up to the call's first sampled token)."""
    for ep in out.episodes:
        s = episode_sample(ep)
        seq = s.prompt_ids + s.completion_ids
        mask = s.loss_mask or [1] * len(s.completion_ids)
        sampled_at = [len(s.prompt_ids) + i for i, m in enumerate(mask) if m]
        lps, vers, i, last = [], [], 0, None
        while i < len(sampled_at):
            start = sampled_at[i]
            (c,) = [c for p, c in rec.calls
                    if p == seq[:start] and c.token_ids == seq[start : start + len(c.token_ids)]]  # fmt: skip
            lps += c.logprobs
            vers += c.versions
            i += len(c.token_ids)
            last = c
        assert i == len(sampled_at)  # the sampled positions are exactly the calls' tokens
        assert s.behaviour_logprobs == lps and s.versions == vers
        # what the trainer's tensors hold: these ids, the loss on the sampled positions only,
        # the engine's logprobs there
        t = collate([s], pad_id=0, device=torch.device("cpu"))
        assert t["inputs_BT"][0].tolist() + [t["targets_BT"][0, -1].item()] == seq
        on = [j + 1 for j in t["mask_BT"][0].nonzero().flatten().tolist()]
        assert on == sampled_at
        assert t["behaviour_BT"][0][t["mask_BT"][0]].tolist() == torch.tensor(lps).tolist()
        if last is not None and last.routed_experts is not None:
            got = torch.as_tensor(ep.routed_experts)
            assert got.shape[0] == len(seq) - 1
            # the last call fed the whole sequence but its last token: its rows are the sample's
            assert torch.equal(got[: last.routed_experts.shape[0]], last.routed_experts)


def train_step(setup, out) -> dict[str, float]:  # type: ignore[no-untyped-def]
    cfg, ts, _, model, _ = setup
    trainer = Trainer(model, cfg.trainer, pad_id=ts.tokenizer.pad_id, temperature=1.0)
    samples = [episode_sample(ep) for ep in out.episodes]
    group = Group(task=TaskRef(task_id=0, index=0), samples=samples)
    return trainer.step(Batch(groups=[group], trainer_version=0))


def test_openai_sdk_agent_episodes_are_the_engines_calls_and_train(setup) -> None:  # type: ignore[no-untyped-def]
    cmd = f"{sys.executable} {AGENTS / 'openai_chat_agent.py'}"
    out, rec, rt = run_agent(setup, cmd, n=2, env={"AGENT_TURNS": "2"})
    assert out.status == "done", out.error
    assert len(rec.calls) == 4
    # the second call extends the first (one sample) unless the first reply's text renders back
    # to other ids (the random policy sampled a special token, which decoding drops): then the
    # two calls are two samples, each exactly as sampled
    tok = setup[1].tokenizer
    firsts = [(p, c) for p, c in rec.calls if p == rec.calls[0][0]]
    assert len(firsts) == 2
    splits = sum(
        tok.chat_prompt([{"role": "user", "content": tok.decode(p[1:])},
                         {"role": "assistant", "content": c.text},
                         {"role": "user", "content": "="}])[: len(p) + len(c.token_ids)]
        != p + c.token_ids
        for p, c in firsts
    )  # fmt: skip
    assert len(out.episodes) == 2 + splits
    assert sum(ep.num_turns for ep in out.episodes) == 4
    check_exact(out, rec)
    st = rt.stats.as_dict()
    assert st["episodes"] == 2 and st["calls"] == 4 and st["rewritten"] == splits
    metrics = train_step(setup, out)
    assert metrics  # a real optimizer step ran on them


def test_curl_agent_and_streaming(setup) -> None:  # type: ignore[no-untyped-def]
    out, rec, _ = run_agent(setup, f"sh {AGENTS / 'curl_agent.sh'}", n=2)
    assert out.status == "done", out.error
    assert len(out.episodes) == 2 and len(rec.calls) == 2
    check_exact(out, rec)
    cmd = f"{sys.executable} {AGENTS / 'openai_chat_agent.py'}"
    out, rec, _ = run_agent(setup, cmd, n=1, env={"AGENT_STREAM": "1", "AGENT_TURNS": "2"})
    assert out.status == "done", out.error
    check_exact(out, rec)


def test_history_rewrite_gives_samples_sharing_the_reward(setup) -> None:  # type: ignore[no-untyped-def]
    cmd = f"{sys.executable} {AGENTS / 'openai_chat_agent.py'}"
    out, rec, rt = run_agent(setup, cmd, n=2, env={"AGENT_TURNS": "2", "AGENT_REWRITE": "1"})
    assert out.status == "done", out.error
    assert len(out.episodes) == 4  # each episode's two calls are two samples
    assert sorted(ep.episode_index for ep in out.episodes) == [0, 0, 1, 1]
    for k in (0, 1):
        rewards = {ep.reward for ep in out.episodes if ep.episode_index == k}
        assert len(rewards) == 1
    assert rt.stats.as_dict()["rewritten"] == 2
    check_exact(out, rec)
    train_step(setup, out)


@pytest.mark.parametrize(
    ("command", "kind", "agent"),
    [
        ("exit 3", "exit_nonzero", {}),
        ("cat > /dev/null; echo '{}'", "no_calls", {}),
        ("sleep 30", "timeout", {"timeout_s": 0.5}),
    ],
)
def test_failing_agents_are_never_rewards(setup, command, kind, agent) -> None:  # type: ignore[no-untyped-def]
    out, rec, rt = run_agent(setup, command, n=2, retries=1, **agent)
    assert out.status == "dropped" and out.episodes == []  # re-run once, then the task dropped
    assert out.infra_failures >= 3  # each failure is retried once; a second gives the task up
    assert rt.stats.as_dict()[kind] >= 2


def test_unbounded_calls_are_refused_past_the_limit(setup) -> None:  # type: ignore[no-untyped-def]
    script = (
        "import json,os,sys\nfrom openai import OpenAI, PermissionDeniedError\n"
        "t=json.load(sys.stdin); c=OpenAI(max_retries=0)\n"
        "for i in range(100):\n"
        "  try: c.completions.create(model=os.environ['OPENAI_MODEL'], prompt=t['prompt'])\n"
        "  except PermissionDeniedError: print(json.dumps({'calls': i})); break\n"
    )
    out, rec, rt = run_agent(setup, f'{sys.executable} -c "{script}"', n=1, max_calls=3)
    assert out.status == "done", out.error
    st = rt.stats.as_dict()
    assert st["calls"] == 3 and st["refused_calls"] == 1
    # three calls whose prompts are the same text: each is its own sample (none extends another)
    assert len(out.episodes) == 3
    check_exact(out, rec)


def _gone(pid: int) -> bool:
    """The process no longer runs (absent, or a zombie nobody reaped yet)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] == "Z"
    except (FileNotFoundError, IndexError):
        return True


def test_malformed_requests_are_counted_and_leftover_processes_killed(setup, tmp_path) -> None:  # type: ignore[no-untyped-def]
    # the agent leaves a background process behind, sends a malformed request, then a good one
    command = (
        'sleep 60 & echo $! >> "$PIDS"\n'
        'curl -sS -o /dev/null -w "%{http_code}\\n" -X POST "$OPENAI_BASE_URL/chat/completions" '
        '-H "Authorization: Bearer $OPENAI_API_KEY" -H "Content-Type: application/json" '
        '-d \'{"messages": [{"role": "user"\'\n'
        f"sh {AGENTS / 'curl_agent.sh'}"
    )
    pids = tmp_path / "pids"
    out, rec, rt = run_agent(setup, command, n=2, env={"PIDS": str(pids)})
    assert out.status == "done", out.error
    assert len(rec.calls) == 2 and len(out.episodes) == 2
    st = rt.stats.as_dict()
    assert st["bad_requests"] == 2 and st["calls"] == 2
    left = [int(p) for p in pids.read_text().split()]
    assert len(left) == 2 and all(_gone(p) for p in left)  # the process groups were killed


def test_worker_acks_good_agents_and_drops_failing_ones(setup) -> None:  # type: ignore[no-untyped-def]
    """Through the rollout worker and a real coordinator: every task ends acked or dropped (none
    pending, none lost), the failing agents' tasks are dropped and counted, and only the good
    agents' groups reach the buffer."""
    from slipstream.config.rl import RolloutConfig
    from slipstream.rl.buffer import ExperienceBuffer
    from slipstream.rl.coordinator import Coordinator
    from slipstream.rl.queue import TaskQueue
    from slipstream.rl.verifier import InProcessVerifier
    from slipstream.rl.worker import RolloutWorker

    cfg, _, engine, _, _ = setup
    ts = get_taskset(cfg.task.model_copy(update={"env": "agent"}))
    rc = RolloutConfig(group_size=2, tasks_per_lease=1, max_inflight_tasks=2, lease_ttl_s=60,
                       max_infra_retries=0, verify_threads=2, drain_timeout_s=5,
                       max_new_tokens=8, max_turns=4)  # fmt: skip
    buffer = ExperienceBuffer(1, 4)
    coord = Coordinator(TaskQueue(ts.num_train, max_tasks=4), buffer)
    # odd train indices: the agent crashes before calling the model
    command = (
        "t=$(cat); case \"$t\" in *'/train/1\"'*|*'/train/3\"'*) exit 1;; esac\n"
        f'echo "$t" | sh {AGENTS / "curl_agent.sh"}'
    )
    worker = RolloutWorker("w0", coord, engine, ts, InProcessVerifier(ts), rc, weights=None,  # type: ignore[arg-type]
                           max_new_tokens=8, agent=AgentConfig(command=command))  # fmt: skip
    t = threading.Thread(target=worker.run)
    t.start()
    try:
        deadline = time.monotonic() + 60
        while coord.queue.stats().num_done < 4:
            assert time.monotonic() < deadline and t.is_alive(), coord.status()
            time.sleep(0.05)
    finally:
        worker.request_stop()
        t.join(60)
    status, report = coord.status(), worker.report()
    assert status.queue_pending_tasks == 0 and status.dropped_tasks == 2
    assert worker.stats["groups_acked"] == 2 and worker.stats["tasks_dropped"] == 2
    assert len(buffer) == 2 and buffer.metrics()["dropped_infra"] == 2
    # each failing group: its first failure drops it; the other episode failed too or was aborted
    assert 2 <= report["agent_exit_nonzero"] <= 4 and report["agent_episodes"] == 4


TOOLS_TEMPLATE = (
    "{{ bos_token }}{% if tools %}<tools>{% for t in tools %}{{ t['function']['name'] }};"
    "{% endfor %}</tools>{% endif %}{% for m in messages %}<{{ m['role'] }}>"
    "{{ m['content'] or '' }}{% for c in (m.tool_calls or []) %}<tool_call>"
    "{{ c['function']['name'] }}({{ c['function']['arguments'] }})</tool_call>{% endfor %}"
    "{{ eos_token }}{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
)


def test_tools_reach_the_template_and_calls_come_back_parsed(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """An `openai`-SDK client with `tools`: the chat template renders them, a Hermes tool call
    in the completion comes back as `tool_calls` (streamed too), and the assistant's tool call and
    the tool's result sent back reach the template."""
    from openai import OpenAI

    from slipstream.model.tokenizer import HFTokenizer

    TOK.save(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    del config["slipstream_tokenizer"]  # a plain HF tokenizer with a tool-rendering template
    config["chat_template"] = TOOLS_TEMPLATE
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    hf = HFTokenizer(tmp_path / "tokenizer.json")
    call = '<tool_call>\n{"name": "calc", "arguments": {"expr": "2+3"}}\n</tool_call>'
    engine = ScriptedEngine([TOK.encode("sure " + call) + [TOK.eos_id], TOK.encode("5") + [2]])
    endpoint = AgentEndpoint(engine, hf, max_turn_tokens=200)
    try:
        s = endpoint.open(max_calls=4, max_sampled_tokens=1000)
        client = OpenAI(base_url=s.base_url, api_key=s.api_key, max_retries=0)
        tools = [{"type": "function", "function": {"name": "calc", "parameters": {
            "type": "object", "properties": {"expr": {"type": "string"}}}}}]  # fmt: skip
        msgs: list[Any] = [{"role": "user", "content": "2+3?"}]
        out = client.chat.completions.create(model="policy", messages=msgs, tools=tools)  # type: ignore[arg-type]
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content == "sure"
        (tc,) = choice.message.tool_calls or []
        assert tc.function.name == "calc" and json.loads(tc.function.arguments) == {"expr": "2+3"}
        assert hf.decode(s.calls[0].prompt_ids).startswith("<tools>calc;</tools><user>2+3?")
        msgs += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": tc.id, "content": "5"}]  # fmt: skip
        out = client.chat.completions.create(model="policy", messages=msgs, tools=tools)  # type: ignore[arg-type]
        assert out.choices[0].message.content == "5" and not out.choices[0].message.tool_calls
        prompt = hf.decode(s.calls[1].prompt_ids)
        assert '<tool_call>calc({"expr": "2+3"})</tool_call>' in prompt and "<tool>5" in prompt
        engine.replies = [TOK.encode(call) + [TOK.eos_id]]
        stream = client.chat.completions.create(model="policy", messages=msgs[:1], tools=tools,  # type: ignore[arg-type]
                                                stream=True)  # fmt: skip
        chunks = list(stream)
        deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
        assert [d.function.name for d in deltas] == ["calc"]
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        s.close()
    finally:
        endpoint.close()
