"""The HTTP server (uvicorn on a loopback socket) driven by the HTTP client engine: the same
behavioural checks as the in-process engine, SGLang response shapes, hot-swap from disk, and bad
requests answered with 4xx while the server keeps serving."""

from __future__ import annotations

import importlib.util
import socket
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

from slipstream.config.engine import EngineConfig
from slipstream.engine import (
    Engine,
    EngineHTTPError,
    GenerateRequest,
    HTTPEngine,
    NativeEngine,
    SamplingParams,
)
from slipstream.model import save_pretrained
from slipstream.model.tokenizer import CharTokenizer

uvicorn = pytest.importorskip("uvicorn")
pytest.importorskip("fastapi")

_CHECKS = Path(__file__).resolve().parents[1] / "unit" / "test_engine_checks.py"
_spec = importlib.util.spec_from_file_location("engine_checks", _CHECKS)
checks = importlib.util.module_from_spec(_spec)
sys.modules["engine_checks"] = checks
_spec.loader.exec_module(checks)

torch.set_num_threads(1)


class Server:
    """uvicorn in a thread, bound to a socket we opened on 127.0.0.1 (no port race)."""

    def __init__(self, app) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True
        )

    def __enter__(self) -> Server:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()


@pytest.fixture(scope="module")
def model():
    return checks.tiny_model()


@pytest.fixture(scope="module")
def served(model, tmp_path_factory):
    from slipstream.engine.server import create_app

    ckpt = tmp_path_factory.mktemp("ckpt")
    save_pretrained(model, ckpt)
    cfg = EngineConfig(kv_cache_tokens=8 * 128, max_seq_len=128, max_batch_size=8)
    engine = NativeEngine(model, cfg, tokenizer=CharTokenizer())
    with Server(create_app(engine, CharTokenizer(), model_path=str(ckpt))) as server:
        client = HTTPEngine(
            server.url,
            max_concurrency=8,
            timeout_s=60,
            max_retries=1,
            backoff_s=0.05,
            model_config=model.config,
        )
        yield server, client, engine, ckpt
        client.close()
    engine.close()


def test_client_satisfies_protocol(served):
    assert isinstance(served[1], Engine)


def test_http_greedy_equals_reference(served, model):
    checks.check_greedy_matches_reference(served[1], model)


def test_http_logprobs_match_recompute(served, model):
    checks.check_logprobs_match_recompute(served[1], model)


def test_http_seeds(served):
    checks.check_seeds(served[1])


def test_http_agenerate_concurrent(served, model):
    import asyncio

    client = served[1]
    reqs = [
        GenerateRequest(p, SamplingParams(temperature=0, max_new_tokens=6))
        for p in checks.prompts(5)
    ]

    async def go():
        return await asyncio.gather(*(client.agenerate([r]) for r in reqs))

    for r, (c,) in zip(reqs, asyncio.run(go()), strict=True):
        assert c.token_ids == checks.reference_greedy(model, r.prompt_ids, 6, set())


def test_sglang_response_shape(served):
    server = served[0]
    body = {
        "text": "!#",  # char ids 5 and 7: inside the tiny vocabulary
        "sampling_params": {"max_new_tokens": 5, "temperature": 0.5, "n": 2, "sampling_seed": 3},
        "return_logprob": True,
        "return_text_in_logprobs": True,
        "rid": "r1",
    }
    out = httpx.post(server.url + "/generate", json=body, timeout=30).json()
    assert isinstance(out, list) and len(out) == 2
    for i, o in enumerate(out):
        meta = o["meta_info"]
        # The text path encodes through the tokenizer's definition: BOS, then the characters.
        assert meta["id"] == f"r1_{i}" and meta["prompt_tokens"] == 3
        assert (
            meta["completion_tokens"] == len(o["output_ids"]) == len(meta["output_token_logprobs"])
        )
        assert meta["finish_reason"]["type"] in ("stop", "length")
        assert [x[1] for x in meta["output_token_logprobs"]] == o["output_ids"]
        assert all(isinstance(x[2], str) for x in meta["output_token_logprobs"])
        assert meta["output_token_versions"] == [0] * len(o["output_ids"])
        assert o["text"] == CharTokenizer().decode(o["output_ids"])
    single = httpx.post(
        server.url + "/generate",
        # ignore_eos: an unseeded sample hits EOS within 3 tokens ~1.5% of the time (measured)
        json={"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}},
        timeout=30,
    ).json()
    assert isinstance(single, dict) and "output_token_logprobs" not in single["meta_info"]
    assert single["meta_info"]["finish_reason"] == {"type": "length", "length": 3}
    info = httpx.get(server.url + "/get_model_info").json()
    assert info["is_generation"] is True and info["weight_version"] == "0"
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/health_generate", timeout=30).status_code == 200
    assert httpx.post(server.url + "/flush_cache").status_code == 200


def test_openai_completions(served, model):
    server = served[0]
    body = {"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0, "logprobs": 0}
    out = httpx.post(server.url + "/v1/completions", json=body, timeout=30).json()
    assert out["object"] == "text_completion" and out["usage"]["completion_tokens"] == 4
    choice = out["choices"][0]
    assert choice["token_ids"] == checks.reference_greedy(model, [5, 6, 7], 4, set())
    assert choice["finish_reason"] == "length" and len(choice["logprobs"]["token_logprobs"]) == 4
    # greedy: the model's logprob of each chosen token (vLLM raw_logprobs), not 0.0
    with torch.no_grad():
        raw = torch.log_softmax(
            model(torch.tensor([[5, 6, 7] + choice["token_ids"]])).logits_BTV[0], -1
        )
    want = [float(raw[2 + i, t]) for i, t in enumerate(choice["token_ids"])]
    assert choice["logprobs"]["token_logprobs"] == pytest.approx(want, abs=1e-4)
    oa = HTTPEngine(server.url, api="openai")
    try:
        reqs = [
            GenerateRequest(
                [5, 6, 7], SamplingParams(temperature=0.8, max_new_tokens=6, seed=4, n=2)
            )
        ]
        via_openai = oa.generate(reqs)
        via_native = served[1].generate(reqs)
        assert [c.token_ids for c in via_openai] == [c.token_ids for c in via_native]
    finally:
        oa.close()


@pytest.mark.parametrize(
    "path,body,needle",
    [
        (
            "/generate",
            {"input_ids": [5], "sampling_params": {"max_new_tokens": 2, "bogus": 1}},
            "bogus",
        ),
        (
            "/generate",
            {"input_ids": [5], "sampling_params": {"max_new_tokens": -1}},
            "max_new_tokens",
        ),
        ("/generate", {"input_ids": [5] * 200}, "does not fit"),
        (
            "/generate",
            {"input_ids": [5], "sampling_params": {"frequency_penalty": 0.5}},
            "frequency_penalty",
        ),
        ("/generate", {"input_ids": [5], "sampling_params": {"top_p": 0}}, "top_p"),
        ("/generate", {"input_ids": [5], "surprise": True}, "surprise"),
        ("/generate", {"sampling_params": {}}, "exactly one"),
        ("/v1/completions", {"prompt": "a", "max_tokens": -3}, "max_tokens"),
        ("/update_weights_from_disk", {"model_path": "/nonexistent"}, "not a directory"),
    ],
)
def test_bad_requests_get_4xx_and_server_keeps_serving(served, path, body, needle):
    server, client = served[0], served[1]
    resp = httpx.post(server.url + path, json=body, timeout=30)
    assert 400 <= resp.status_code < 500, resp.text
    assert needle in resp.text
    assert client.generate([GenerateRequest([5, 6], SamplingParams(max_new_tokens=2))])[0].token_ids


def test_client_error_is_clear_and_not_retried(served):
    with pytest.raises(EngineHTTPError, match="does not fit") as e:
        served[1].generate([GenerateRequest([5] * 300)])
    assert e.value.status_code == 400


def test_client_retries_then_fails_on_connection_errors():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    client = HTTPEngine(f"http://127.0.0.1:{port}", max_retries=2, backoff_s=0.01, timeout_s=5)
    try:
        with pytest.raises(EngineHTTPError, match="after 3 attempts"):
            client.generate([GenerateRequest([5])])
    finally:
        client.close()


def test_http_hot_swap_from_disk(served, tmp_path):
    server, client, engine, ckpt = served
    new = checks.tiny_model(seed=5)
    save_pretrained(new, tmp_path / "v7")
    cfg = EngineConfig(kv_cache_tokens=8 * 128, max_seq_len=128, max_batch_size=8)
    with NativeEngine(new, cfg) as fresh:
        expected = fresh.generate(checks.hot_swap_requests())
    try:
        checks.check_hot_swap(
            client, lambda: client.update_weights(7, str(tmp_path / "v7")), expected, 7
        )
        assert httpx.get(server.url + "/get_model_info").json()["weight_version"] == "7"
    finally:
        client.update_weights(8, str(ckpt))  # restore for other tests (versions only go up)


def test_sglang_weight_version_labels_and_model_path_flow(served, tmp_path):
    """SGLang's test_weight_version and update-and-revert flow: free-form string versions
    (our integer versions kept underneath), /get_weight_version, /update_weight_version,
    meta_info / OpenAI metadata weight_version, and /get_model_info.model_path following
    /update_weights_from_disk (the served name loads the served directory back)."""
    server, _, engine, ckpt = served
    url = server.url

    def label() -> str:
        got = httpx.get(url + "/get_weight_version").json()["weight_version"]
        assert httpx.get(url + "/get_model_info").json()["weight_version"] == got
        return got

    def generated() -> dict:
        body = {"text": "1+1=", "sampling_params": {"temperature": 0, "max_new_tokens": 2}}
        return httpx.post(url + "/generate", json=body, timeout=60).json()["meta_info"]

    assert label() == str(engine.version)
    before = engine.version
    resp = httpx.post(
        url + "/update_weight_version",
        json={"new_version": "updated_version_2.0", "abort_all_requests": False},
    )
    assert resp.json() == {
        "success": True,
        "new_version": "updated_version_2.0",
        "message": "Weight version updated to updated_version_2.0",
    }
    assert label() == "updated_version_2.0" and engine.version == before
    meta = generated()
    assert meta["weight_version"] == "updated_version_2.0"
    assert meta["output_token_versions"] == [before] * 2  # the integers stay
    chat = httpx.post(
        url + "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "1+1="}], "max_tokens": 2, "temperature": 0},
        timeout=60,
    )
    cmpl = httpx.post(url + "/v1/completions", json={"prompt": "1+1=", "max_tokens": 2},
                      timeout=60)  # fmt: skip
    assert chat.json()["metadata"]["weight_version"] == "updated_version_2.0"
    assert cmpl.json()["metadata"]["weight_version"] == "updated_version_2.0"
    bad = httpx.post(url + "/update_weight_version", json={"new_version": "  "})
    assert bad.status_code == 400 and "new_version" in bad.json()["error"]["message"]

    # the served name (not the server's directory) loads the directory it started from
    served_name = httpx.post(
        url + "/update_weights_from_disk",
        json={"model_path": ckpt.name, "weight_version": "base"},
        timeout=60,
    )
    assert served_name.status_code == 200, served_name.text
    before = engine.version
    origin = httpx.get(url + "/get_model_info").json()["model_path"]
    assert origin == ckpt.name and label() == "base"
    other = tmp_path / "other"
    save_pretrained(checks.tiny_model(), other)
    resp = httpx.post(
        url + "/update_weights_from_disk",
        json={
            "model_path": str(other),
            "load_format": "auto",
            "weight_version": "disk_update_v2.0.0",
        },
        timeout=60,
    )
    assert resp.status_code == 200, resp.text
    assert label() == "disk_update_v2.0.0" and engine.version == before + 1
    assert httpx.get(url + "/get_model_info").json()["model_path"] == str(other)
    assert generated()["output_token_versions"] == [before + 1] * 2
    resp = httpx.post(url + "/update_weights_from_disk", json={"model_path": origin},
                      timeout=60)  # fmt: skip
    assert resp.status_code == 200, resp.text
    assert httpx.get(url + "/get_model_info").json()["model_path"] == origin
    assert label() == str(before + 2)  # no label given: the integer


def test_client_retries_5xx_with_backoff_but_not_4xx():
    """A stand-in server (real HTTP; its answers are canned) failing with 503 twice, then 200."""
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse

    calls = {"n": 0}
    app = FastAPI()

    @app.post("/generate")
    async def generate(body: dict):
        calls["n"] += 1
        if body["input_ids"] == [9]:
            return JSONResponse({"error": {"message": "no such thing"}}, status_code=404)
        if calls["n"] <= 2:
            return JSONResponse({"error": {"message": "overloaded"}}, status_code=503)
        meta = {
            "id": body["rid"],
            "finish_reason": {"type": "length", "length": 1},
            "weight_version": "4",
            "output_token_logprobs": [[-0.5, 7, None]],
        }
        return {"text": "", "output_ids": [7], "meta_info": meta}

    with Server(app) as server:
        client = HTTPEngine(server.url, max_retries=3, backoff_s=0.01)
        try:
            (c,) = client.generate([GenerateRequest([5], SamplingParams(max_new_tokens=1))])
            assert (
                calls["n"] == 3
                and c.token_ids == [7]
                and c.logprobs == [-0.5]
                and c.versions == [4]
            )
            with pytest.raises(EngineHTTPError, match="404: no such thing"):
                client.generate([GenerateRequest([9])])
            assert calls["n"] == 4
        finally:
            client.close()


@pytest.mark.slow
def test_slipstream_serve_command(tmp_path, model):
    """The real CLI in a subprocess: load the HF directory, serve, answer, stop on SIGTERM."""
    import os
    import signal
    import subprocess

    save_pretrained(model, tmp_path / "m")
    CharTokenizer().save(tmp_path / "m")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    exe = Path(sys.executable).parent / "slipstream"
    cmd = [
        str(exe),
        "serve",
        "--model",
        str(tmp_path / "m"),
        "--port",
        str(port),
        "--engine.max_seq_len=64",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read().decode()
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "server did not come up"
            time.sleep(0.2)
        out = httpx.post(
            url + "/generate",
            json={"text": "!#", "sampling_params": {"max_new_tokens": 4, "temperature": 0}},
            timeout=30,
        ).json()
        expected = checks.reference_greedy(model, CharTokenizer().encode_prompt("!#"), 4, set())
        assert out["output_ids"][: len(expected)] == expected[: len(out["output_ids"])]
        assert out["meta_info"]["finish_reason"]["type"] in ("stop", "length")
        resp = httpx.post(url + "/generate", json={"input_ids": [5] * 64}, timeout=30)
        assert resp.status_code == 400 and "does not fit" in resp.text
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)


def test_wait_ready_waits_for_a_starting_server_and_times_out_naming_it(model) -> None:
    """A rollout worker may start before the server beside it: wait_ready polls /health."""
    from slipstream.engine.server import create_app

    cfg = EngineConfig(kv_cache_tokens=4 * 128, max_seq_len=128, max_batch_size=4)
    engine = NativeEngine(model, cfg, tokenizer=CharTokenizer())
    server = Server(create_app(engine, CharTokenizer()))
    client = HTTPEngine(server.url, max_retries=0)
    try:
        with pytest.raises(EngineHTTPError, match=f"{server.url}/health: server not ready"):
            client.wait_ready(timeout_s=0.3, poll_s=0.1)  # bound, not listening yet
        starter = threading.Timer(0.5, server.__enter__)
        starter.start()
        t0 = time.monotonic()
        client.wait_ready(timeout_s=30, poll_s=0.1)
        assert time.monotonic() - t0 >= 0.4
        starter.join()
    finally:
        client.close()
        server.__exit__()
        engine.close()


def test_http_routing_round_trips_exactly(served, model):
    """return_routed_experts over HTTP: the client decodes SGLang's base64 int32 payload into
    the same Completion.routed_experts the native engine gives (with the model's config, and
    from the server's layout extra without it), equal to a plain forward's routing."""
    server, client, engine = served[0], served[1], served[2]
    checks.check_routing_matches_forward(client, model)
    bare = HTTPEngine(server.url, max_retries=0)  # no model_config: uses routed_experts_layout
    try:
        checks.check_routing_matches_forward(bare, model)
        reqs = [GenerateRequest([5, 6, 7], SamplingParams(temperature=0.9, max_new_tokens=6,
                                                          seed=3, n=2, top_logprobs=2,
                                                          prompt_logprobs=2,
                                                          return_routed_experts=True))]  # fmt: skip
        native, http = engine.generate(reqs), bare.generate(reqs)
        for a, b in zip(native, http, strict=True):
            assert torch.equal(a.routed_experts, b.routed_experts)
            assert a.routed_experts.dtype == b.routed_experts.dtype == torch.uint8
            assert a.token_ids == b.token_ids
            assert a.prompt_logprobs == pytest.approx(b.prompt_logprobs)
            for mine, theirs in ((a.top_logprobs, b.top_logprobs),
                                 (a.prompt_top_logprobs, b.prompt_top_logprobs)):  # fmt: skip
                assert len(mine) == len(theirs)
                for x, y in zip(mine, theirs, strict=True):
                    assert (x is None) == (y is None)
                    if x is not None:
                        assert [t for t, _ in x] == [t for t, _ in y]
                        assert [lp for _, lp in x] == pytest.approx([lp for _, lp in y])
    finally:
        bare.close()


def test_sglang_routed_experts_wire_format(served, model):
    """As SGLang clients (slime, miles) read it: base64 little-endian int32 of shape
    (len(prompt + output) - 1, num_hidden_layers, top-k); routed_experts_start_len drops the
    first rows."""
    import base64

    import numpy as np

    server = served[0]
    body = {"input_ids": [5, 6, 7, 8], "sampling_params": {"max_new_tokens": 5, "temperature": 0},
            "return_routed_experts": True}  # fmt: skip
    out = httpx.post(server.url + "/generate", json=body, timeout=30).json()
    seq = [5, 6, 7, 8, *out["output_ids"]]
    cfg = model.config
    arr = np.frombuffer(base64.b64decode(out["meta_info"]["routed_experts"]), dtype=np.int32)
    arr = arr.reshape(len(seq) - 1, cfg.num_hidden_layers, cfg.num_experts_per_tok)
    assert np.array_equal(arr, checks.reference_routing(model, seq[:-1]).numpy())
    tail = httpx.post(server.url + "/generate", json={**body, "routed_experts_start_len": 3},
                      timeout=30).json()  # fmt: skip
    arr3 = np.frombuffer(base64.b64decode(tail["meta_info"]["routed_experts"]), dtype=np.int32)
    assert np.array_equal(arr3.reshape(-1, cfg.num_hidden_layers, 2), arr[3:])
    plain = httpx.post(server.url + "/generate", json={**body, "return_routed_experts": False},
                       timeout=30).json()  # fmt: skip
    assert "routed_experts" not in plain["meta_info"]


def test_prefix_cache_is_reported_and_flushed(model):
    """meta_info.cached_tokens, OpenAI usage.prompt_tokens_details.cached_tokens (asked for, as
    vLLM's --enable-prompt-tokens-details), the hit rate on /metrics, and /flush_cache emptying
    the cache."""
    from slipstream.engine.guard import ServeOptions
    from slipstream.engine.server import create_app

    cfg = EngineConfig(kv_cache_tokens=4 * 128, max_seq_len=128, max_batch_size=4,
                       prefix_cache_tokens=1024)  # fmt: skip
    prompt = [5 + i % 20 for i in range(40)]
    body = {"input_ids": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": 3}}
    with NativeEngine(model, cfg, tokenizer=CharTokenizer()) as engine:
        app = create_app(engine, CharTokenizer(), "m",
                         ServeOptions(enable_prompt_tokens_details=True))  # fmt: skip
        with Server(app) as server:
            metas = [httpx.post(server.url + "/generate", json=body, timeout=30).json()["meta_info"]
                     for _ in range(2)]  # fmt: skip
            assert [m["cached_tokens"] for m in metas] == [0, 32]
            out = httpx.post(server.url + "/v1/completions", json={"prompt": prompt,
                             "max_tokens": 2}, timeout=30).json()  # fmt: skip
            assert out["usage"]["prompt_tokens_details"] == {"cached_tokens": 32}
            metrics = httpx.get(server.url + "/metrics").text
            assert "slipstream_engine_prefix_cache_hit_tokens_total 64.0" in metrics
            assert "slipstream_engine_prefix_cache_query_tokens_total 120.0" in metrics
            assert httpx.post(server.url + "/flush_cache").status_code == 200
            again = httpx.post(server.url + "/generate", json=body, timeout=30).json()
            assert again["meta_info"]["cached_tokens"] == 0
