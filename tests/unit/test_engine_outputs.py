"""The native engine's optional outputs and its failure isolation: MoE routing against plain
forwards, top-n and prompt logprobs against recomputation, per-token streaming, prefill-only
requests, validated weight loads (the old weights keep serving), a failing hook or forward
confined to its requests, and health."""

from __future__ import annotations

import json
import math

import pytest
import torch
from test_engine_checks import (
    check_routing_matches_forward,
    prompts,
    reference_greedy,
    tiny_model,
)

from slipstream.config.engine import EngineConfig
from slipstream.engine import GenerateRequest, NativeEngine, SamplingParams
from slipstream.engine.base import StreamEvent
from slipstream.engine.sampling import RowParams, processed_logprobs
from slipstream.model import save_pretrained
from slipstream.model.tokenizer import CharTokenizer

torch.set_num_threads(1)


def make_engine(model, slots: int = 8, slot_len: int = 128, **kw) -> NativeEngine:
    cfg = EngineConfig(kv_cache_tokens=slots * slot_len, max_seq_len=slot_len,
                       max_batch_size=slots)  # fmt: skip
    return NativeEngine(model, cfg, **kw)


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module")
def engine(model):
    with make_engine(model) as eng:
        yield eng


def _ok(engine: NativeEngine, model) -> None:
    """A normal greedy request still gives the reference answer."""
    p = prompts(1, seed=3)[0]
    (c,) = engine.generate([GenerateRequest(p, SamplingParams(temperature=0, max_new_tokens=5))])
    assert c.token_ids == reference_greedy(model, p, 5, set())


def test_routing_matches_plain_forward(engine, model):
    check_routing_matches_forward(engine, model)


def test_routing_under_slot_pressure_and_moves(model):
    """Rows finishing at different times compact the batch (moving their routing rows); later
    admissions reuse freed slots. Three slots for six requests."""
    with make_engine(model, slots=3) as eng:
        check_routing_matches_forward(eng, model)


def test_default_path_records_nothing(model):
    with make_engine(model) as eng:
        eng.generate([GenerateRequest(p, SamplingParams(max_new_tokens=6, n=2, seed=1))
                      for p in prompts(3)])  # fmt: skip
        assert eng.batch.route_NSLk is None and eng.batch.top_ids_NSW is None
        assert all(b.routing_sink is None for b in eng._routing.blocks)


def test_routing_int16_for_many_experts():
    from slipstream.engine.routing import routing_dtype

    assert routing_dtype(256) == torch.uint8 and routing_dtype(257) == torch.int16
    with pytest.raises(ValueError, match="int16"):
        routing_dtype(2**15 + 1)


@torch.no_grad()
def test_top_logprobs_are_the_raw_distribution(engine, model):
    """Top-n is the model's raw top-n (as SGLang top_logprobs_num / vLLM raw_logprobs) at any
    temperature and filter; the sampled token's own logprob stays the processed one, but a
    greedy row's is the raw one (SGLang's greedy sampler, vLLM raw_logprobs), never 0.0."""
    params = SamplingParams(temperature=0.8, top_k=6, max_new_tokens=6, seed=5, top_logprobs=4)
    greedy = SamplingParams(temperature=0, max_new_tokens=4, top_logprobs=3)
    p1, p2 = prompts(2, seed=9)
    results = engine.generate([GenerateRequest(p1, params), GenerateRequest(p2, greedy)])
    for c, sp in zip(results, (params, greedy), strict=True):
        assert c.top_logprobs is not None and len(c.top_logprobs) == len(c.token_ids)
        logits = model(torch.tensor([c.prompt_ids + c.token_ids])).logits_BTV[0]
        for i, (tok, alts) in enumerate(zip(c.token_ids, c.top_logprobs, strict=True)):
            pos_V = logits[len(c.prompt_ids) - 1 + i]
            raw = torch.log_softmax(pos_V.float(), dim=-1)
            assert len(alts) == sp.top_logprobs
            assert [t for t, _ in alts] == raw.topk(sp.top_logprobs).indices.tolist()
            assert all(abs(lp - float(raw[t])) < 1e-4 for t, lp in alts)
            processed = processed_logprobs(pos_V[None],
                                           RowParams.build([sp], model.config.vocab_size))[0]  # fmt: skip
            want = raw[tok] if sp.greedy else processed[tok]
            assert c.logprobs[i] == pytest.approx(float(want), abs=1e-4)
            if sp.greedy:  # the argmax is the raw top-1
                assert alts[0][0] == tok and alts[0][1] < 0.0
                assert alts[0][1] == pytest.approx(c.logprobs[i], abs=1e-5)


@torch.no_grad()
def test_prompt_logprobs_and_prefill_only(engine, model):
    p = prompts(3, seed=4)[2]
    logits = model(torch.tensor([p])).logits_BTV[0]
    ref = torch.log_softmax(logits, dim=-1)
    for max_new in (3, 0):
        sp = SamplingParams(temperature=0, max_new_tokens=max_new, prompt_logprobs=2,
                            return_routed_experts=True)  # fmt: skip
        (c,) = engine.generate([GenerateRequest(p, sp)])
        assert len(c.token_ids) == max_new and c.finish_reason == "length"
        assert c.prompt_logprobs[0] is None and c.prompt_top_logprobs[0] is None
        for j in range(1, len(p)):
            assert abs(c.prompt_logprobs[j] - float(ref[j - 1, p[j]])) < 1e-4
            assert [t for t, _ in c.prompt_top_logprobs[j]] == ref[j - 1].topk(2).indices.tolist()
        assert c.routed_experts.shape[0] == len(p) + max_new - 1


def test_stream_events_equal_the_completion(engine, model):
    events: list[StreamEvent] = []
    ps = prompts(3, seed=12)
    streamed = GenerateRequest(
        ps[0],
        SamplingParams(temperature=1.0, max_new_tokens=10, n=2, seed=7, top_logprobs=2),
        stream=events.append,
    )
    others = [GenerateRequest(p, SamplingParams(max_new_tokens=6, seed=1)) for p in ps[1:]]
    results = engine.generate([*others, streamed])
    for c in (c for c in results if c.request_id == streamed.request_id):
        mine = [e for e in events if e.index == c.index]
        assert mine[-1].completion is c
        tokens = mine[:-1]
        assert [e.token_id for e in tokens] == c.token_ids
        assert [e.logprob for e in tokens] == pytest.approx(c.logprobs)
        assert [e.version for e in tokens] == c.versions
        assert [e.top_logprobs for e in tokens] == c.top_logprobs


def test_a_failing_stream_hook_aborts_only_its_request(engine, model):
    def bad(event: StreamEvent) -> None:
        raise RuntimeError("client hook broke")

    p = prompts(1, seed=13)[0]
    bad_req = GenerateRequest(p, SamplingParams(max_new_tokens=40, seed=1), stream=bad)
    good_req = GenerateRequest(p, SamplingParams(temperature=0, max_new_tokens=5))
    bad_c, good_c = engine.generate([bad_req, good_req])
    assert bad_c.finish_reason == "abort"
    assert good_c.token_ids == reference_greedy(model, p, 5, set())


def test_a_failing_forward_fails_its_requests_and_the_engine_keeps_serving(model):
    with make_engine(model) as eng:
        original = eng.model.forward
        calls = {"n": 0}

        def broken(*a, **kw):  # noqa: ANN002, ANN003, ANN202
            calls["n"] += 1
            if calls["n"] == 1:
                raise RuntimeError("simulated kernel failure")
            return original(*a, **kw)

        eng.model.forward = broken
        with pytest.raises(RuntimeError, match="simulated kernel failure"):
            eng.generate([GenerateRequest([5, 6], SamplingParams(max_new_tokens=3))])
        del eng.model.forward
        assert eng.healthy
        _ok(eng, model)


def _bad_sources(tmp_path, model) -> dict[str, object]:
    good = tmp_path / "good"
    save_pretrained(model, good)
    data = (good / "model.safetensors").read_bytes()
    out: dict[str, object] = {}
    trunc = tmp_path / "trunc"
    trunc.mkdir()
    (trunc / "model.safetensors").write_bytes(data[: len(data) // 2])
    out["unreadable safetensors"] = trunc
    rnd = tmp_path / "random"
    rnd.mkdir()
    (rnd / "model.safetensors").write_bytes(torch.randint(0, 256, (4096,), dtype=torch.uint8)
                                            .numpy().tobytes())  # fmt: skip
    out["unreadable safetensors "] = rnd
    idx = tmp_path / "index"
    idx.mkdir()
    (idx / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"x": "a.safetensors"}})
    )
    out["No such file"] = idx
    state = {k: v.clone() for k, v in model.state_dict().items()}
    nan = dict(state)
    nan["model.norm.weight"] = torch.full_like(state["model.norm.weight"], math.nan)
    out["model.norm.weight.*NaN or inf"] = nan
    incomplete = dict(state)
    del incomplete["model.norm.weight"]
    out["missing"] = incomplete
    shape = dict(state)
    shape["model.norm.weight"] = torch.ones(3)
    out["shape"] = shape
    ints = dict(state)
    ints["model.norm.weight"] = torch.ones_like(state["model.norm.weight"], dtype=torch.int64)
    out["not floating point"] = ints
    return out


def test_bad_weight_sources_are_refused_and_the_old_weights_keep_serving(model, tmp_path):
    with make_engine(model, tokenizer=CharTokenizer()) as eng:
        for needle, source in _bad_sources(tmp_path, model).items():
            with pytest.raises((ValueError, OSError), match=needle.strip()):
                eng.update_weights(1, source)
            assert eng.version == 0 and eng.healthy
            _ok(eng, model)
        for bad_version in (-5, 2**40, 1.5):
            with pytest.raises(ValueError, match="weight version"):
                eng.update_weights(bad_version, model.state_dict())
        eng.update_weights(2, tmp_path / "good")  # a valid load still works afterwards
        assert eng.version == 2
        _ok(eng, model)


def test_validation_bounds_every_field(engine):
    for kw in [dict(top_k=2**70), dict(stop_token_ids=[2**70]), dict(seed=2**70),
               dict(temperature=math.inf), dict(temperature=1e-9), dict(top_logprobs=99),
               dict(max_new_tokens=2**40), dict(n=0)]:  # fmt: skip
        with pytest.raises(ValueError, match=next(iter(kw)).split("_ids")[0]):
            SamplingParams(**kw)
    with pytest.raises(ValueError, match="prompt token id"):
        GenerateRequest([2**70])
    with pytest.raises(ValueError, match="outside"):
        engine.submit(GenerateRequest([10**6]))
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=41)


def test_dead_engine_refuses_work_and_reports_unhealthy(model):
    eng = make_engine(model)
    eng.close()
    assert not eng.healthy
    with pytest.raises(RuntimeError, match="closed"):
        eng.submit(GenerateRequest([5]))
    with pytest.raises(RuntimeError):
        eng.wait_ready(1)


def test_aborting_rows_with_optional_outputs_keeps_the_engine_serving(model):
    """Rows removed by the scheduler (abort) move their lazily allocated top-n and routing
    buffers outside the engine step's inference mode."""
    import time

    with make_engine(model) as eng:
        sp = SamplingParams(max_new_tokens=100, seed=1, top_logprobs=2, return_routed_experts=True,
                            n=2, stop_token_ids=tuple(range(30, 36)))  # fmt: skip
        long = [GenerateRequest(p, sp) for p in prompts(3, seed=40)]
        futures = [eng.submit(r) for r in long]
        while eng.stats["decode_steps"] < 3:
            time.sleep(0.005)
        eng.abort(long[0].request_id)
        done = [c for f in futures for c in f.result(timeout=60)]
        assert {c.finish_reason for c in done if c.request_id == long[0].request_id} <= {
            "abort",
            "stop",
            "length",
        }
        for c in done:
            assert not c.routed_experts.is_inference()
            assert c.routed_experts.shape[0] == len(c.prompt_ids) + len(c.token_ids) - 1
        assert eng.healthy
        _ok(eng, model)
