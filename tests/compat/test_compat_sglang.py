"""SGLang's native API: the assertions of SGLang's own endpoint tests (test/srt: test_srt_endpoint
run_decode / parallel sample / logprob tests, test_update_weights_from_disk,
test_weight_version, test_abort, the cached_tokens report) against `slipstream serve`."""

from __future__ import annotations

import base64
import json
import math
import threading

import httpx
import pytest
from compat_registry import covers
from compat_server import Served


def generate(served: Served, **body: object) -> dict:
    resp = httpx.post(served.url + "/generate", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp.json()


@covers("generate", "generate_sampling", "meta_info")
def test_decode_batch_parallel_sample_and_meta(served):
    sp = {"temperature": 0, "max_new_tokens": 16}
    out = generate(served, text="12+34=", sampling_params=sp)
    meta = out["meta_info"]
    assert set(meta) >= {"id", "finish_reason", "prompt_tokens", "completion_tokens",
                         "cached_tokens", "weight_version", "e2e_latency"}  # fmt: skip
    assert meta["prompt_tokens"] == 7 and meta["completion_tokens"] == len(out["output_ids"]) <= 16
    assert meta["finish_reason"]["type"] in ("stop", "length") and isinstance(out["text"], str)
    # a batch of texts and a batch of ids; greedy: the same prompt gives the same text
    batch = generate(served, text=["12+34=", "12+34="], sampling_params=sp)
    assert [o["text"] for o in batch] == [out["text"]] * 2
    ids = generate(served, input_ids=[[1, *range(5, 11)]] * 2, sampling_params=sp)
    assert len(ids) == 2 and ids[0]["output_ids"] == ids[1]["output_ids"]
    # test_parallel_sample: n samples per prompt, rids rid_i
    par = generate(served, text="7-5=", rid="r1", sampling_params={"temperature": 1.0, "n": 3,
                   "max_new_tokens": 8, "sampling_seed": 3})  # fmt: skip
    assert [o["meta_info"]["id"] for o in par] == ["r1_0", "r1_1", "r1_2"]
    # stop strings are trimmed from the text; stop_token_ids end with matched = the id
    first = out["output_ids"][2]
    stopped = generate(served, text="12+34=", sampling_params={**sp, "stop_token_ids": [first]})
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": first}


@covers("generate_logprob", "generate_top_logprobs")
def test_logprobs_start_len_and_top_n(served):
    body = {"text": "12+34=", "sampling_params": {"temperature": 0, "max_new_tokens": 6},
            "return_logprob": True, "top_logprobs_num": 5, "logprob_start_len": 0,
            "return_text_in_logprobs": True}  # fmt: skip
    meta = generate(served, **body)["meta_info"]
    n_in, n_out = meta["prompt_tokens"], meta["completion_tokens"]
    assert len(meta["input_token_logprobs"]) == n_in and meta["input_token_logprobs"][0][0] is None
    assert len(meta["output_token_logprobs"]) == n_out == len(meta["output_top_logprobs"])
    assert all(isinstance(x[2], str) for x in meta["output_token_logprobs"])
    for (lp, tok, _), tops in zip(meta["output_token_logprobs"], meta["output_top_logprobs"],
                                  strict=True):  # fmt: skip
        assert len(tops) == 5 and tops[0][1] == tok  # greedy: the raw top-1
        # SGLang's greedy sampler returns log_softmax(logits): the chosen token's logprob is the
        # model's (the raw top-1's), never 0.0 (the tiny model is not that sure of anything)
        assert lp == pytest.approx(tops[0][0], abs=1e-5) and lp < 0.0
        assert all(t[0] <= lp + 1e-5 for t in tops)
    later = generate(served, **{**body, "logprob_start_len": 3})["meta_info"]
    assert len(later["input_token_logprobs"]) == n_in - 3
    assert later["input_token_logprobs"] == meta["input_token_logprobs"][3:]


@covers("generate_sampling")
def test_top_k_and_min_p_keep_only_the_tokens_they_allow(served):
    """`/generate` sampling_params over HTTP: with top_k = 2 every sampled token is one of the
    raw top-2 at its position; with min_p = 0.5 its probability (at the request's temperature,
    SGLang's order) is at least half the top token's; without them some tokens are neither."""
    base = {"text": "12+34=", "return_logprob": True, "top_logprobs_num": 20}

    def tokens(temperature: float, **sp: object) -> list[tuple[int, list[list]]]:
        out = []
        for seed in range(6):
            meta = generate(served, **base, sampling_params={
                "temperature": temperature, "max_new_tokens": 8, "ignore_eos": True,
                "sampling_seed": seed, **sp})["meta_info"]  # fmt: skip
            out += [(t[1], tops) for t, tops in zip(meta["output_token_logprobs"],
                                                    meta["output_top_logprobs"], strict=True)]  # fmt: skip
        return out

    def in_top2(tok: int, tops: list[list]) -> bool:
        return tok in [t[1] for t in tops[:2]]

    def half_of_top(tok: int, tops: list[list]) -> bool:  # at temperature 1: p ~ exp(lp)
        raw = {t[1]: t[0] for t in tops}
        return tok in raw and raw[tok] - tops[0][0] >= math.log(0.5) - 1e-6

    assert not all(in_top2(*x) for x in tokens(3.0))
    assert all(in_top2(*x) for x in tokens(3.0, top_k=2))
    assert not all(half_of_top(*x) for x in tokens(1.0))
    assert all(half_of_top(*x) for x in tokens(1.0, min_p=0.5))


@covers("routed_experts")
def test_routed_experts_decode_to_the_documented_shape(served):
    out = generate(served, input_ids=[1, 5, 6, 7], return_routed_experts=True,
                   sampling_params={"temperature": 0, "max_new_tokens": 4})  # fmt: skip
    meta = out["meta_info"]
    rows, layers, k = meta["routed_experts_layout"]["shape"]
    assert rows == 4 + len(out["output_ids"]) - 1
    assert len(base64.b64decode(meta["routed_experts"])) == rows * layers * k * 4  # int32


@covers("generate_stream")
def test_stream_events_are_cumulative_and_end_with_done(served):
    body = {"text": "12+34=", "stream": True,
            "sampling_params": {"temperature": 0, "max_new_tokens": 8}}  # fmt: skip
    full = generate(served, **{**body, "stream": False})
    events = []
    with httpx.stream("POST", served.url + "/generate", json=body, timeout=60) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: ") :])
    assert events[-1] == "[DONE]"
    outs = [json.loads(e) for e in events[:-1]]
    assert outs[-1]["text"] == full["text"] and outs[-1]["output_ids"] == full["output_ids"]
    assert [o["meta_info"]["finish_reason"] for o in outs[:-1]] == [None] * (len(outs) - 1)
    assert all(full["text"].startswith(o["text"]) for o in outs)


@covers("prefix_cache", "flush_cache", "metrics")
def test_cached_tokens_of_a_resent_prompt_and_flush(served):
    assert httpx.post(served.url + "/flush_cache").status_code == 200
    prompt = [1] + [5 + i % 30 for i in range(50)]
    body = {"input_ids": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": 4}}
    first, again = generate(served, **body), generate(served, **body)
    assert first["meta_info"]["cached_tokens"] == 0 and again["meta_info"]["cached_tokens"] == 48
    assert first["output_ids"] == again["output_ids"]
    turn2 = prompt + again["output_ids"] + [7, 8, 9]
    assert generate(served, input_ids=turn2, sampling_params=body["sampling_params"])[
        "meta_info"]["cached_tokens"] == 48  # fmt: skip
    metrics = httpx.get(served.url + "/metrics").text
    assert "slipstream_engine_prefix_cache_hit_tokens_total" in metrics
    httpx.post(served.url + "/flush_cache")
    assert generate(served, **body)["meta_info"]["cached_tokens"] == 0


@covers("update_weights_from_disk", "model_info", "weight_version")
def test_update_weights_from_disk_and_revert_with_versions(served):
    url = served.url
    sp = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
    info = httpx.get(url + "/get_model_info").json()
    origin = info["model_path"]
    # serve --weight-version test_version_1.0 (this is the suite's only test that updates)
    assert info["weight_version"] == "test_version_1.0"
    assert httpx.get(url + "/get_weight_version").json()["weight_version"] == "test_version_1.0"
    meta = generate(served, text="1", sampling_params=sp)["meta_info"]
    assert meta["weight_version"] == "test_version_1.0" and meta["output_token_versions"][0] == 0
    before = generate(served, text="12+34=", sampling_params=sp)["output_ids"]
    resp = httpx.post(url + "/update_weights_from_disk", json={"model_path": str(served.other),
                      "weight_version": "disk_update_v2.0.0"}, timeout=60).json()  # fmt: skip
    assert resp["success"] is True and "Succeeded" in resp["message"]
    assert httpx.get(url + "/get_model_info").json()["model_path"] == str(served.other)
    assert httpx.get(url + "/get_weight_version").json()["weight_version"] == "disk_update_v2.0.0"
    changed = generate(served, text="12+34=", sampling_params=sp)
    assert changed["output_ids"] != before
    assert changed["meta_info"]["weight_version"] == "disk_update_v2.0.0"
    relabel = httpx.post(url + "/update_weight_version", json={"new_version": "v3",
                         "abort_all_requests": False}).json()  # fmt: skip
    assert relabel["success"] is True and relabel["new_version"] == "v3"
    assert httpx.get(url + "/get_model_info").json()["weight_version"] == "v3"
    resp = httpx.post(url + "/update_weights_from_disk", json={"model_path": origin},
                      timeout=60).json()  # fmt: skip
    assert resp["success"] is True
    assert httpx.get(url + "/get_model_info").json()["model_path"] == origin
    assert generate(served, text="12+34=", sampling_params=sp)["output_ids"] == before


@covers("abort")
def test_abort_all_ends_a_running_request_with_abort(served):
    body = {"input_ids": [1, 5], "stream": True, "sampling_params": {
        "max_new_tokens": 120, "ignore_eos": True, "n": 4}}  # fmt: skip
    events: list[dict] = []
    started = threading.Event()

    def read() -> None:
        with httpx.stream("POST", served.url + "/generate", json=body, timeout=60) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    events.append(json.loads(line[len("data: ") :]))
                    started.set()

    reader = threading.Thread(target=read)
    reader.start()
    assert started.wait(60)
    assert httpx.post(served.url + "/abort_request", json={"abort_all": True}).status_code == 200
    reader.join(60)
    finals = [e["meta_info"]["finish_reason"] for e in events if e["meta_info"]["finish_reason"]]
    assert len(finals) == 4 and {f["type"] for f in finals} == {"abort"}


@covers("health")
def test_health_endpoints(served):
    assert httpx.get(served.url + "/health").status_code == 200
    assert httpx.get(served.url + "/health_generate", timeout=60).status_code == 200
