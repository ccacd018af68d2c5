"""The native engine against plain model forwards: greedy equivalence under continuous batching,
behaviour logprobs, seeds, stop conditions, KV budget, abort and weight hot-swap policies."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from test_engine_checks import (
    EOS,
    check_greedy_matches_reference,
    check_hot_swap,
    check_logprobs_match_recompute,
    check_seeds,
    hot_swap_requests,
    prompts,
    reference_greedy,
    tiny_model,
)

from slipstream.config.engine import EngineConfig
from slipstream.engine import Engine, GenerateRequest, NativeEngine, SamplingParams
from slipstream.engine.sampling import counter_uniform
from slipstream.model.tokenizer import CharTokenizer

torch.set_num_threads(1)


def make_engine(model, slots: int = 8, slot_len: int = 128, **kw) -> NativeEngine:
    cfg = EngineConfig(
        kv_cache_tokens=slots * slot_len, max_seq_len=slot_len, max_batch_size=slots, **kw
    )
    return NativeEngine(model, cfg)


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module")
def engine(model):
    with make_engine(model) as eng:
        yield eng


def test_engine_satisfies_protocol(engine):
    assert isinstance(engine, Engine)


def test_greedy_equals_reference_any_batch(engine, model):
    check_greedy_matches_reference(engine, model)


def test_greedy_with_requests_queueing_for_slots(model):
    # 3 slots for 6 requests (plus 2-sample groups): rows leave and join mid-flight.
    with make_engine(model, slots=3) as eng:
        check_greedy_matches_reference(eng, model)


def test_requests_arriving_while_decoding(model):
    ps = prompts(5, seed=3)
    reqs = [GenerateRequest(p, SamplingParams(temperature=0, max_new_tokens=20)) for p in ps]
    with make_engine(model, slots=4) as eng:
        futures = []
        for r in reqs:
            futures.append(eng.submit(r))
            time.sleep(0.003)
        for r, f in zip(reqs, futures, strict=True):
            assert f.result()[0].token_ids == reference_greedy(model, r.prompt_ids, 20, set())


def test_logprobs_match_recompute(engine, model):
    check_logprobs_match_recompute(engine, model)


def test_seeds(engine):
    check_seeds(engine)


def test_counter_uniform_is_uniform_and_keyed():
    steps = torch.arange(20000)
    u = counter_uniform(torch.full_like(steps, 7), torch.zeros_like(steps), steps)
    assert 0 < float(u.min()) and float(u.max()) < 1
    assert abs(float(u.mean()) - 0.5) < 0.01
    hist = torch.histc(u, bins=10, min=0, max=1) / len(u)
    assert float((hist - 0.1).abs().max()) < 0.01
    v = counter_uniform(torch.full_like(steps, 8), torch.zeros_like(steps), steps)
    assert not torch.equal(u, v)


def test_stop_tokens_strings_and_lengths(model):
    tok = CharTokenizer()
    cfg = EngineConfig(kv_cache_tokens=4 * 64, max_seq_len=64, max_batch_size=4)
    ps = prompts(1, seed=5)[0]
    with NativeEngine(model, cfg, tokenizer=tok) as eng:
        free = eng.generate(
            [GenerateRequest(ps, SamplingParams(temperature=0, max_new_tokens=30, ignore_eos=True))]
        )[0]
        assert free.finish_reason == "length" and len(free.token_ids) == 30
        assert free.text == tok.decode(free.token_ids)
        # stop on the 5th generated token id
        stop_tok = free.token_ids[4]
        first = free.token_ids.index(stop_tok)
        c = eng.generate(
            [
                GenerateRequest(
                    ps,
                    SamplingParams(
                        temperature=0, max_new_tokens=30, stop_token_ids=[stop_tok], ignore_eos=True
                    ),
                )
            ]
        )[0]
        assert (
            c.token_ids == free.token_ids[: first + 1]
            and c.finish_reason == "stop"
            and c.matched_stop == stop_tok
        )
        # stop string made of two consecutive generated characters
        text = tok.decode(free.token_ids)
        stop_str = text[6:8]
        c = eng.generate(
            [
                GenerateRequest(
                    ps,
                    SamplingParams(
                        temperature=0, max_new_tokens=30, stop=[stop_str], ignore_eos=True
                    ),
                )
            ]
        )[0]
        assert c.finish_reason == "stop" and c.matched_stop == stop_str
        assert c.text == text[: text.find(stop_str)] and stop_str in tok.decode(c.token_ids)
        # the slot end caps a long request: prompt + completion - 1 <= 64 positions
        c = eng.generate(
            [
                GenerateRequest(
                    ps,
                    SamplingParams(temperature=1.0, max_new_tokens=1000, ignore_eos=True, seed=1),
                )
            ]
        )[0]
        assert c.finish_reason == "length" and len(ps) + len(c.token_ids) - 1 == 64
        # max_new_tokens=0 completes at once
        c = eng.generate([GenerateRequest(ps, SamplingParams(max_new_tokens=0))])[0]
        assert c.token_ids == [] and c.finish_reason == "length"


def test_eos_from_tokenizer_ends_samples():
    # A flat random model (default init) emits EOS at about 1/V per step, so lengths vary.
    flat = tiny_model()
    with torch.no_grad():
        for p in flat.parameters():
            p.mul_(0.1)
    cfg = EngineConfig(kv_cache_tokens=8 * 128, max_seq_len=128, max_batch_size=8)
    with NativeEngine(flat, cfg, tokenizer=CharTokenizer()) as eng:
        reqs = [
            GenerateRequest(p, SamplingParams(max_new_tokens=100, seed=i, n=4))
            for i, p in enumerate(prompts(4))
        ]
        results = eng.generate(reqs)
    stopped = [c for c in results if c.finish_reason == "stop"]
    assert len(stopped) >= 8
    for c in stopped:
        assert c.token_ids[-1] == EOS and EOS not in c.token_ids[:-1] and c.matched_stop == EOS
    assert len({len(c.token_ids) for c in results}) > 3


def test_bad_requests_raise(engine):
    with pytest.raises(ValueError, match="does not fit"):
        engine.submit(GenerateRequest([3] * 128))
    with pytest.raises(ValueError, match="KV slots"):
        engine.submit(GenerateRequest([3], SamplingParams(n=9)))
    with pytest.raises(ValueError, match="outside"):
        engine.submit(GenerateRequest([3, 999]))
    with pytest.raises(ValueError, match="max_new_tokens"):
        SamplingParams(max_new_tokens=-1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    # still serving
    assert engine.generate([GenerateRequest([3, 4], SamplingParams(max_new_tokens=2))])[0].token_ids


def _wait_for_tokens(eng: NativeEngine, count: int) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if len(eng.batch) and int(eng.batch.gen_N[: len(eng.batch)].max()) >= count:
            return
        time.sleep(0.0005)
    raise AssertionError("engine produced no tokens")


def _long_request(seed: int = 0) -> GenerateRequest:
    return GenerateRequest(
        [5, 6, 7], SamplingParams(temperature=1.0, max_new_tokens=500, ignore_eos=True, seed=seed)
    )


def test_abort_keeps_tokens(model):
    with make_engine(model, slot_len=512, slots=2) as eng:
        req = _long_request()
        fut = eng.submit(req)
        _wait_for_tokens(eng, 3)
        eng.abort(req.request_id)
        c = fut.result(timeout=30)[0]
        assert c.finish_reason == "abort" and 3 <= len(c.token_ids) < 500
        assert len(c.logprobs) == len(c.versions) == len(c.token_ids)


def test_hot_swap_matches_fresh_engine(model):
    new = tiny_model(seed=1)
    with make_engine(new) as fresh:
        expected = fresh.generate(hot_swap_requests())
    with make_engine(tiny_model()) as eng:
        eng.generate(hot_swap_requests())  # warm on the old weights
        check_hot_swap(eng, lambda: eng.update_weights(3, new.state_dict()), expected, 3)


def test_hot_swap_from_hf_directory(tmp_path):
    from slipstream.model import save_pretrained

    new = tiny_model(seed=2)
    save_pretrained(new, tmp_path / "ckpt")
    with make_engine(new) as fresh:
        expected = fresh.generate(hot_swap_requests())
    with make_engine(tiny_model()) as eng:
        check_hot_swap(eng, lambda: eng.update_weights(1, str(tmp_path / "ckpt")), expected, 1)
        with pytest.raises(ValueError):
            eng.update_weights(2, str(tmp_path / "missing"))
        with pytest.raises(ValueError, match="neither model.safetensors"):
            eng.update_weights(2, (tmp_path / "missing").as_uri().replace("missing", ""))
        assert eng.version == 1
        # a URL (fsspec): back to the original weights, then the same outputs as a fresh engine
        save_pretrained(tiny_model(), tmp_path / "v0")
        eng.update_weights(5, (tmp_path / "v0").as_uri())
        with make_engine(tiny_model()) as fresh:
            want = fresh.generate(hot_swap_requests())
        got = eng.generate(hot_swap_requests())
        assert [c.token_ids for c in got] == [c.token_ids for c in want]
        assert {v for c in got for v in c.versions} == {5}


def test_mid_flight_continue_new_tags_versions(model):
    with make_engine(
        tiny_model(), slot_len=512, slots=2, weight_update_policy="continue_new"
    ) as eng:
        fut = eng.submit(_long_request())
        _wait_for_tokens(eng, 3)
        eng.update_weights(1, tiny_model(seed=1).state_dict())
        c = fut.result(timeout=60)[0]
        switch = c.versions.index(1)
        assert 3 <= switch < 500 and c.versions == [0] * switch + [1] * (500 - switch)


def test_mid_flight_finish_old_drains_first(model):
    with make_engine(tiny_model(), slot_len=512, slots=2, weight_update_policy="finish_old") as eng:
        old = eng.submit(_long_request())
        _wait_for_tokens(eng, 3)
        updater = threading.Thread(
            target=eng.update_weights, args=(1, tiny_model(seed=1).state_dict())
        )
        updater.start()
        deadline = time.monotonic() + 30
        while eng._pending_update is None:  # the update is registered: new requests now wait
            assert time.monotonic() < deadline
            time.sleep(0.001)
        new = eng.submit(GenerateRequest([5, 6], SamplingParams(max_new_tokens=5, seed=1)))
        updater.join(timeout=60)
        assert old.result()[0].versions == [0] * 500
        assert new.result(timeout=60)[0].versions == [1] * 5


def test_mid_flight_abort_policy(model):
    with make_engine(tiny_model(), slot_len=512, slots=2, weight_update_policy="abort") as eng:
        fut = eng.submit(_long_request())
        _wait_for_tokens(eng, 3)
        eng.update_weights(1, tiny_model(seed=1).state_dict())
        c = fut.result(timeout=60)[0]
        assert c.finish_reason == "abort" and set(c.versions) == {0}


def test_processed_logprobs_matches_reference_filters():
    from test_engine_checks import reference_logprob

    from slipstream.engine import RowParams, processed_logprobs

    g = torch.Generator().manual_seed(0)
    logits_BV = torch.randn(5, 40, generator=g) * 3
    params = [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.5, top_p=0.7),
        SamplingParams(temperature=1.5, top_k=3),
        SamplingParams(temperature=0.8, min_p=0.2),
        SamplingParams(temperature=0.0),
    ]
    lp_BV = processed_logprobs(logits_BV, RowParams.build(params, 40))
    for b, p in enumerate(params):
        support = torch.isfinite(lp_BV[b]).nonzero().flatten().tolist()
        assert abs(float(lp_BV[b].exp().sum()) - 1) < 1e-5
        for tok in support:
            if p.temperature == 0:
                assert support == [int(logits_BV[b].argmax())]
            else:
                assert abs(float(lp_BV[b, tok]) - reference_logprob(logits_BV[b], p, tok)) < 1e-5
    assert len(torch.isfinite(lp_BV[2]).nonzero()) == 3


def test_close_aborts_running_and_waiting(model):
    eng = make_engine(model, slot_len=512, slots=1)
    running = eng.submit(_long_request())
    _wait_for_tokens(eng, 2)
    waiting = eng.submit(_long_request(seed=1))
    eng.close()
    assert running.result(timeout=30)[0].finish_reason == "abort"
    assert waiting.result(timeout=30)[0].finish_reason == "abort"
    with pytest.raises(RuntimeError, match="closed"):
        eng.submit(_long_request())
