"""The episode loop and the environments without sandboxes: token in/token out through the real
native engine (the trained ids are the sampled and observed ids, byte for byte), single-turn
groups as one request, aborts, engine failures, bounded re-runs after infrastructure failures
and the give-up, episode bounds, tool-call syntax, observations and demonstrations."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch

from slipstream.config import load_config
from slipstream.config.task import TaskConfig
from slipstream.engine import NativeEngine
from slipstream.envs import (
    Demonstration,
    EnvUsage,
    EpisodeLimits,
    EpisodeRunner,
    GroupOutcome,
    InfraError,
    StepResult,
    demonstration,
    encode_observation,
    make_env_factory,
    run_episodes,
)
from slipstream.envs.python_tool import observation_text, tool_call
from slipstream.model import MoEForCausalLM
from slipstream.rl.trainer import collate
from slipstream.rl.worker import episode_sample
from slipstream.tasks import Task, get_taskset

TINY = ["model.hidden_size=32", "model.num_hidden_layers=1", "model.num_attention_heads=2",
        "model.num_key_value_heads=1", "model.head_dim=16", "model.moe_intermediate_size=32",
        "model.num_experts=4", "model.num_experts_per_tok=2", "model.vocab_size=99",
        "model.max_position_embeddings=96"]  # fmt: skip


class Recording:
    """A real NativeEngine whose requests and completions are recorded on the way through."""

    def __init__(self, engine: NativeEngine) -> None:
        self.engine = engine
        self.calls: list[tuple[list[int], Any, list[Any]]] = []
        self.lock = threading.Lock()

    def submit(self, request):  # type: ignore[no-untyped-def]
        fut = self.engine.submit(request)

        def record(f):  # type: ignore[no-untyped-def]
            if f.exception() is None:
                with self.lock:
                    self.calls.append((list(request.prompt_ids), request.params, f.result()))

        fut.add_done_callback(record)
        return fut

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    @property
    def max_seq_len(self) -> int:
        return self.engine.max_seq_len


class EchoEnv:
    """A multi-turn test environment: every turn gets the same observation ids back (chosen so
    that decoding and re-encoding them would not give them back: BOS and pad ids, which the char
    tokenizer's decode drops), until `turns` turns; reward = 1 / turns taken."""

    stop: tuple[str, ...] = ()
    OBS = [1, 0, 40, 41, 0]

    def __init__(self, taskset, turns: int = 3, fail_steps: int = 0, **_: Any) -> None:  # type: ignore[no-untyped-def]
        self.taskset, self.turns, self.fail_steps = taskset, turns, fail_steps
        self.usage = EnvUsage()
        self.n = 0
        self.closed = 0
        self.failures = fail_steps

    def reset(self, task: Task) -> list[int]:
        self.n = 0
        return self.taskset.prompt_ids(task)

    def step(self, action_ids: Sequence[int], *, last: bool) -> StepResult:
        self.n += 1
        if self.failures:
            self.failures -= 1
            raise InfraError("the test's infrastructure failed")
        if last or self.n >= self.turns:
            return StepResult([], 1.0 / self.n, True, f"{self.n} turns")
        return StepResult(list(self.OBS), 0.0, False, "more")

    def demonstration(self, task: Task) -> Demonstration:
        return Demonstration(self.taskset.prompt_ids(task), [5, 2])

    def close(self) -> None:
        self.closed += 1


@pytest.fixture(scope="module")
def setup():  # type: ignore[no-untyped-def]
    cfg = load_config(None, TINY)
    ts = get_taskset(cfg.task)
    torch.manual_seed(0)
    model = MoEForCausalLM(cfg.model)
    engine = NativeEngine(model, cfg.engine.model_copy(update={"max_batch_size": 16,
                          "kv_cache_tokens": 16 * 96}), tokenizer=ts.tokenizer)  # fmt: skip
    pool = ThreadPoolExecutor(8)
    yield ts, engine, pool
    engine.close()
    pool.shutdown()


def run_group(runner: EpisodeRunner, task: Task, n: int, seed: int | None = 7) -> GroupOutcome:
    (out,) = run_episodes(runner, [task], n, seed=seed, timeout_s=120)
    return out


def test_token_in_token_out_through_the_native_engine(setup) -> None:  # type: ignore[no-untyped-def]
    ts, engine, pool = setup
    rec = Recording(engine)
    envs: list[EchoEnv] = []

    def make() -> EchoEnv:
        envs.append(EchoEnv(ts, turns=3))
        return envs[-1]

    limits = EpisodeLimits(max_turns=5, max_turn_tokens=6, max_observation_tokens=8)
    runner = EpisodeRunner(rec, make, ts.tokenizer, limits, pool, temperature=1.0,  # type: ignore[arg-type]
                           context_tokens=engine.max_seq_len)  # fmt: skip
    out = run_group(runner, ts.train(0), n=4)
    assert out.status == "done" and len(out.episodes) == 4
    assert all(e.closed == 1 for e in envs)
    first = [c for c in rec.calls if c[1].n == 4]
    assert len(first) == 1  # the group's first turn is one request with n = 4 (shared prefill)
    for i, ep in enumerate(out.episodes):
        # rebuild the episode from what the engine was asked and answered, turn by turn
        seq = list(ts.prompt_ids(ts.train(0)))
        assert ep.prompt_ids == seq
        comps = [first[0][2][i]]
        while len(comps) < ep.num_turns:
            nxt = [c for p, _, cs in rec.calls for c in cs if p == seq + _flat(comps)]
            assert len(nxt) == 1, "each later turn's prompt is the sequence so far, exactly"
            comps.append(nxt[0])
        expect_ids, expect_mask, lps, vers = [], [], [], []
        for k, c in enumerate(comps):
            expect_ids += c.token_ids
            expect_mask += [1] * len(c.token_ids)
            lps += c.logprobs
            vers += c.versions
            if k < len(comps) - 1:
                expect_ids += EchoEnv.OBS
                expect_mask += [0] * len(EchoEnv.OBS)
        assert ep.completion_ids == expect_ids and ep.loss_mask == expect_mask
        assert ep.logprobs == lps and ep.versions == vers
        s = episode_sample(ep)
        t = collate([s], pad_id=ts.tokenizer.pad_id, device=torch.device("cpu"))
        trained = t["inputs_BT"][0].tolist() + [t["targets_BT"][0, -1].item()]
        assert trained == ep.prompt_ids + expect_ids  # the trained ids are the ids, byte for byte
        # a decode -> encode round trip would not have given them back (BOS/pad are dropped)
        assert ts.tokenizer.encode(ts.tokenizer.decode(expect_ids)) != expect_ids
        assert ep.reprefill_tokens > 0 and ep.prefill_tokens > ep.reprefill_tokens


def _flat(comps: list[Any]) -> list[int]:
    out: list[int] = []
    for c in comps:
        out += c.token_ids + EchoEnv.OBS
    return out


def test_single_turn_group_is_one_request_scored_by_the_scorer(setup) -> None:  # type: ignore[no-untyped-def]
    ts, engine, pool = setup
    rec = Recording(engine)
    seen: list[str] = []

    def scorer(task: Task, text: str) -> tuple[float, str]:
        seen.append(text)
        return 0.25, "scored"

    limits = EpisodeLimits(max_turn_tokens=5)
    runner = EpisodeRunner(rec, make_env_factory(ts, scorer=scorer, limits=limits), ts.tokenizer,  # type: ignore[arg-type]
                           limits, pool, context_tokens=engine.max_seq_len)  # fmt: skip
    out = run_group(runner, ts.train(3), n=8)
    assert out.status == "done" and out.requests == 1 and len(rec.calls) == 1
    prompt, params, comps = rec.calls[0]
    assert prompt == ts.prompt_ids(ts.train(3)) and params.n == 8 and params.stop == ()
    assert params.max_new_tokens == 5
    for ep, c in zip(out.episodes, comps, strict=True):
        assert ep.completion_ids == c.token_ids and ep.loss_mask == [1] * len(c.token_ids)
        assert ep.reward == 0.25 and ep.num_turns == 1
        s = episode_sample(ep)
        assert s.loss_mask == [] and s.completion_ids == c.token_ids  # stored as before
    assert sorted(seen) == sorted(ts.tokenizer.decode(c.token_ids) for c in comps)


def test_infra_failures_rerun_the_episode_then_give_up(setup) -> None:  # type: ignore[no-untyped-def]
    ts, engine, pool = setup
    limits = EpisodeLimits(max_turns=2, max_turn_tokens=4, max_infra_retries=2)
    made: list[EchoEnv] = []
    fails = iter([1, 0, 0, 0])  # episode 0's first attempt fails in its first step

    def make() -> EchoEnv:
        made.append(EchoEnv(ts, turns=2, fail_steps=next(fails, 0)))
        return made[-1]

    runner = EpisodeRunner(engine, make, ts.tokenizer, limits, pool, context_tokens=96)
    out = run_group(runner, ts.train(1), n=3)
    assert out.status == "done" and out.infra_failures == 1
    assert sorted(e.infra_retries for e in out.episodes) == [0, 0, 1]
    assert all(e.reward == 0.5 for e in out.episodes)  # real rewards, none from the failure
    assert all(e.closed == 1 for e in made) and len(made) == 4

    made.clear()
    always = EpisodeRunner(engine, lambda: made.append(EchoEnv(ts, fail_steps=99)) or made[-1],
                           ts.tokenizer, limits, pool, context_tokens=96)  # fmt: skip
    out = run_group(always, ts.train(2), n=3)
    assert out.status == "dropped" and out.episodes == []
    assert out.infra_failures >= limits.max_infra_retries + 1
    assert "infrastructure failures" in out.error
    assert all(e.closed == 1 for e in made)


def test_abort_and_engine_failure_end_the_group_once(setup) -> None:  # type: ignore[no-untyped-def]
    ts, engine, pool = setup
    limits = EpisodeLimits(max_turns=50, max_turn_tokens=4, max_observation_tokens=1)
    made: list[EchoEnv] = []
    runner = EpisodeRunner(engine, lambda: made.append(EchoEnv(ts, turns=10**6)) or made[-1],
                           ts.tokenizer, limits, pool, context_tokens=96)  # fmt: skip
    done = threading.Event()
    outs: list[GroupOutcome] = []
    rollout = runner.start(ts.train(0), 4, lambda o: (outs.append(o), done.set()))
    rollout.abort()
    assert done.wait(60) and len(outs) == 1
    assert outs[0].status == "aborted" and all(e.closed == 1 for e in made)

    class Broken:
        def submit(self, request):  # type: ignore[no-untyped-def]
            raise RuntimeError("engine is closed")

        def abort(self, request_id: str) -> None:
            pass

    broken = EpisodeRunner(Broken(), make_env_factory(ts), ts.tokenizer, limits, pool)  # type: ignore[arg-type]
    out = run_group(broken, ts.train(0), n=2)
    assert out.status == "failed" and "engine is closed" in out.error


def test_episode_bounds_end_turns(setup) -> None:  # type: ignore[no-untyped-def]
    ts, engine, pool = setup
    # max_turns
    lim = EpisodeLimits(max_turns=2, max_turn_tokens=3, max_observation_tokens=5)
    r = EpisodeRunner(engine, lambda: EchoEnv(ts, turns=99), ts.tokenizer, lim, pool,
                      context_tokens=96)  # fmt: skip
    assert {e.num_turns for e in run_group(r, ts.train(0), 2).episodes} == {2}
    # episode token budget: after each turn of <= 3 tokens, the next needs room for an
    # observation (5) and a token; 12 tokens allow 2 turns at most
    lim = EpisodeLimits(max_turns=99, max_turn_tokens=3, max_observation_tokens=5,
                        max_episode_tokens=12)  # fmt: skip
    r = EpisodeRunner(engine, lambda: EchoEnv(ts, turns=99), ts.tokenizer, lim, pool,
                      context_tokens=96)  # fmt: skip
    for e in run_group(r, ts.train(0), 2).episodes:
        assert len(e.completion_ids) <= 12 and e.num_turns <= 2


def test_tool_call_syntax_and_observations() -> None:
    assert tool_call("<py>print(1)</py>") == "print(1)"
    assert tool_call("12<py>a</py><py>print(2)</py>") == "print(2)"
    assert tool_call("print(1)</py>") is None and tool_call("<py>print(1)") is None
    assert observation_text("99242\n") == "<out>99242\n</out>"
    assert observation_text("", "boom\n", 1) == "<out>boom\n[exit 1]\n</out>"
    assert observation_text("", timed_out=True) == "<out>[timed out]\n</out>"
    long = observation_text("x" * 500 + "END", max_chars=40)
    assert len(long) == 40 and long.startswith("<out>x") and "..." in long
    assert long.endswith("END</out>")
    ts = get_taskset(TaskConfig())
    tok = ts.tokenizer
    ids = encode_observation(tok, "caf\u00e9<eos>\x00ok", 100)
    assert tok.decode(ids) == "caf?<eos>?ok"  # unknown characters become "?", never raise
    assert tok.eos_id not in ids and len(encode_observation(tok, "y" * 50, 8)) == 8


def test_tool_arithmetic_demonstrations_mask_the_observation() -> None:
    cfg = TaskConfig(name="tool_arithmetic", env="python_tool", ops=["*"], min_digits=3,
                     max_digits=3, demo_tool_use=0.5)  # fmt: skip
    ts = get_taskset(cfg)
    tok = ts.tokenizer
    used = 0
    for i in range(40):
        task = ts.train(i)
        demo = demonstration(ts, task)
        text = tok.decode(demo.completion_ids)
        answer = str(task.meta["answer"])
        assert text.endswith(answer) and demo.completion_ids[-1] == tok.eos_id
        if ts.uses_tool(task):
            used += 1
            expr = task.prompt[:-1]
            assert text == f"<py>{expr}</py><out>{answer}\n</out>{answer}"
            obs = tok.encode(f"<out>{answer}\n</out>")
            start = len(tok.encode(f"<py>{expr}</py>"))
            assert demo.loss_mask[start : start + len(obs)] == [0] * len(obs)
            assert sum(demo.loss_mask) == len(demo.completion_ids) - len(obs)
        else:
            assert text == answer and demo.loss_mask == [1] * len(demo.completion_ids)
    assert 10 <= used <= 30  # about half, by a keyed hash
    # the single-turn adapter's demonstration is exactly the old SFT target
    plain = get_taskset(TaskConfig())
    d = demonstration(plain, plain.train(0))
    assert d.prompt_ids == plain.prompt_ids(plain.train(0))
    assert d.completion_ids == plain.completion_ids(plain.demonstration(plain.train(0)))


def test_versions_follow_weight_updates_across_turns(setup) -> None:  # type: ignore[no-untyped-def]
    ts, _, pool = setup
    cfg = load_config(None, TINY)
    torch.manual_seed(1)
    model = MoEForCausalLM(cfg.model)
    engine = NativeEngine(model, cfg.engine.model_copy(update={"max_batch_size": 4,
                          "kv_cache_tokens": 4 * 96}), tokenizer=ts.tokenizer)  # fmt: skip
    state = {k: v.clone() for k, v in model.state_dict().items()}

    class UpdatingEnv(EchoEnv):
        def step(self, action_ids: Sequence[int], *, last: bool) -> StepResult:
            if self.n == 0:  # between turn 1 and turn 2 the trainer publishes version 1
                engine.update_weights(1, state)
            return super().step(action_ids, last=last)

    limits = EpisodeLimits(max_turns=3, max_turn_tokens=4, max_observation_tokens=8)
    runner = EpisodeRunner(engine, lambda: UpdatingEnv(ts, turns=2), ts.tokenizer, limits, pool,
                           context_tokens=engine.max_seq_len)  # fmt: skip
    try:
        (out,) = run_episodes(runner, [ts.train(0)], n=1, seed=3)
    finally:
        engine.close()
        runner.close()
    (ep,) = out.episodes
    first = ep.loss_mask.index(0)  # the first turn's tokens, then the observation
    assert ep.num_turns == 2 and set(ep.versions[:first]) == {0}
    assert set(ep.versions[first:]) == {1}  # the second turn was sampled by version 1
    s = episode_sample(ep)
    assert s.oldest_version == 0 and len(s.versions) == s.num_sampled
