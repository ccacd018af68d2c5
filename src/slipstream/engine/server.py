"""HTTP server over the native engine: SGLang's native API plus OpenAI's completions, chat
completions and models endpoints (`openai_api.py`).

SGLang endpoints: POST /generate (streaming too), POST /update_weights_from_disk, POST|GET
/flush_cache, POST /abort_request, GET /get_model_info, GET /get_weight_version, POST
/update_weight_version (string labels over integer versions: `weight_versions.py`), GET /health,
GET /health_generate; and
GET /metrics (Prometheus: requests, latency, engine health and counters; observe/prometheus.py).
Concurrent requests share the engine's running batch (continuous batching).

Every failure stays with its request: a request that cannot run (bad or out-of-range field,
unsupported option, prompt too long, rid in use) gets 400 in OpenAI's error shape
(`guard.error_response`) before anything runs; a weight source that fails validation gets 400
and the old weights keep serving; a client that disconnects has its requests aborted; an engine
that can no longer serve makes /health answer 503. Authentication, size limits, weight-source
schemes and version rules are `guard.py`'s (see docs/security.md).

SGLang's weight-transfer endpoints (/init_weights_update_group, /update_weights_from_distributed,
/get_weights_by_name, ...) are engine/weight_routes.py's.

Not covered: /get_server_info, tokenize endpoints,
multimodal inputs, TLS.
"""

from __future__ import annotations

import asyncio
import reprlib
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from slipstream.engine.base import Completion, GenerateRequest, SamplingParams
from slipstream.engine.guard import (
    ADMIN_PATHS,
    PUBLIC_PATHS,
    GuardedRoute,
    GuardMiddleware,
    ServeOptions,
    check_weight_source,
    error_body,
    error_response,
)
from slipstream.engine.native import NativeEngine
from slipstream.engine.protocol import (
    AbortReqInput,
    GenerateReqInput,
    SGLSamplingParams,
    UpdateWeightFromDiskReqInput,
    UpdateWeightVersionReqInput,
    generate_output,
)
from slipstream.engine.server_state import ServerState
from slipstream.engine.streaming import ClientGone, TextStream, sse
from slipstream.engine.weight_versions import check_label
from slipstream.observe.prometheus import RequestMetrics, ServeMetrics


def _as_list(value: Any, n: int, name: str) -> list[Any]:
    if isinstance(value, list):
        if len(value) != n:
            raise ValueError(f"{name} has {len(value)} entries for {n} prompts")
        return value
    return [value] * n


# Paths /metrics counts by name (besides the guard's admin and public ones); others: "other".
METRICS_ENDPOINTS = frozenset({"/generate", "/get_model_info", "/metrics", "/v1/completions",
                               "/v1/chat/completions", "/v1/models"})  # fmt: skip


def create_app(
    engine: NativeEngine,
    tokenizer: Any = None,
    model_path: str = "",
    options: ServeOptions | None = None,
    weight_version: str | None = None,
) -> FastAPI:
    """The FastAPI app serving `engine`. `tokenizer` encodes text prompts and chat messages and
    decodes texts. `options` default: served name = the model directory's name.
    `weight_version`: the label of the weights served at start (SGLang's --weight-version)."""
    from slipstream.engine.openai_api import add_openai_routes
    from slipstream.engine.weight_routes import add_weight_routes

    if options is None:
        options = ServeOptions(served_model_name=Path(model_path).name or "slipstream")
    app = FastAPI(title="slipstream engine server")
    app.router.route_class = GuardedRoute  # JSON bodies parsed by guard.parse_json_body
    app.add_middleware(GuardMiddleware, options=options)
    metrics = ServeMetrics(engine, endpoints=ADMIN_PATHS | PUBLIC_PATHS | METRICS_ENDPOINTS)
    app.add_middleware(RequestMetrics, metrics=metrics)  # outermost: counts refused ones too
    state = ServerState(engine, tokenizer, model_path, options)
    if weight_version is not None:
        state.versions.set(engine.version, check_label("weight_version", weight_version))
    app.state.slipstream = state

    @app.exception_handler(RequestValidationError)
    async def _bad_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        parts, param = [], None
        for e in exc.errors():
            loc = ".".join(str(p) for p in e["loc"] if p != "body")
            param = param or loc
            shown = reprlib.repr(e.get("input"))  # bounded: the input may be a 2M-item list
            shown = shown if len(shown) <= 60 else shown[:57] + "..."
            parts.append(f"{loc}: {e['msg']} (got {shown})")
        return error_response(400, "invalid request: " + "; ".join(parts[:5]), param)

    @app.exception_handler(StarletteHTTPException)  # FastAPI's and Starlette's (body parsing)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(ValueError)
    async def _bad_value(request: Request, exc: ValueError) -> JSONResponse:
        return error_response(400, str(exc))

    @app.exception_handler(ClientGone)
    async def _gone(request: Request, exc: ClientGone) -> Response:
        return error_response(499, "client disconnected; its requests were aborted")

    @app.exception_handler(RuntimeError)
    async def _engine_error(request: Request, exc: RuntimeError) -> JSONResponse:
        status = 503 if not engine.healthy else 500
        return error_response(status, f"engine error: {exc}")

    @app.get("/health")
    async def health() -> Response:
        if not engine.healthy:
            return error_response(503, f"engine not serving: {engine.error or 'closed'}")
        problem = weight_routes.degraded()  # weight_routes.py: its own bounded executor
        if problem is not None:
            return error_response(503, problem)
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate(request: Request) -> Response:
        probe = GenerateRequest([0], SamplingParams(max_new_tokens=1, temperature=0.7),
                                f"health-{uuid.uuid4().hex}")  # fmt: skip
        try:
            await asyncio.wait_for(state.runner.run(request, [probe]), timeout=60)
        except (RuntimeError, TimeoutError) as e:
            return error_response(503, f"engine could not generate: {e}")
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        status, body = metrics.render()
        return Response(body, status_code=status, media_type=metrics.content_type)

    @app.get("/get_model_info")
    async def get_model_info() -> dict[str, Any]:
        return {
            "model_path": state.reported_model_path,
            "tokenizer_path": options.served_model_name,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": state.versions.label(engine.version),
        }

    @app.get("/get_weight_version")
    async def get_weight_version() -> dict[str, Any]:
        return {"weight_version": state.versions.label(engine.version)}

    @app.post("/update_weight_version")
    async def update_weight_version(obj: UpdateWeightVersionReqInput) -> dict[str, Any]:
        """SGLang's relabel of the served weights (no weight change, same integer version)."""
        label = check_label("new_version", obj.new_version)
        async with state.update_lock:
            if obj.abort_all_requests:
                engine.abort_all()
            state.versions.set(engine.version, label)
        return {"success": True, "message": f"Weight version updated to {label}",
                "new_version": label}  # fmt: skip

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> Response:
        engine.flush_cache()
        return PlainTextResponse("Cache flushed.\n", status_code=200)

    @app.post("/abort_request")
    async def abort_request(obj: AbortReqInput) -> Response:
        if obj.abort_all:
            engine.abort_all()
        elif obj.rid:
            engine.abort(obj.rid)
        return Response(status_code=200)

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(obj: UpdateWeightFromDiskReqInput) -> JSONResponse:
        def failed(status: int, message: str) -> JSONResponse:  # SGLang's shape + the error
            extra = {"success": False, "message": message, "num_paused_requests": 0}
            return error_response(status, message, extra=extra)

        if obj.load_format not in (None, "auto", "safetensors"):
            return failed(400, f"load_format {obj.load_format!r} is not supported (safetensors)")
        async with state.update_lock:  # one load at a time; the others wait their turn
            try:
                version, label = state.versions.resolve(obj.weight_version, engine.version,
                                                        options)  # fmt: skip
                source = state.weight_source(obj.model_path)
                check_weight_source(source, options)
            except ValueError as e:
                return failed(400, str(e))
            if obj.abort_all_requests:
                engine.abort_all()
            try:
                await asyncio.to_thread(engine.update_weights, version, source)
            except (ValueError, OSError) as e:
                return failed(400, f"update failed, version {engine.version} still serving: {e}")
            except RuntimeError as e:
                return failed(503, f"update failed: {e}")
            state.versions.set(version, label)
            state.reported_model_path = obj.model_path
        message = f"Succeeded to update model weights (version {state.versions.label(version)})."
        return JSONResponse({"success": True, "message": message, "num_paused_requests": 0})

    @app.post("/generate")
    async def generate(obj: GenerateReqInput, request: Request) -> Any:
        if (obj.text is None) == (obj.input_ids is None):
            raise ValueError("give exactly one of text or input_ids")
        raw = obj.text if obj.text is not None else obj.input_ids
        state.check_prompt_count(raw)
        if obj.text is not None:
            batched = isinstance(obj.text, list)
            prompts = [state.encode(t) for t in (obj.text if batched else [obj.text])]
        else:
            ids = obj.input_ids or []
            batched = bool(ids) and isinstance(ids[0], list)
            prompts = [list(p) for p in ids] if batched else [list(ids)]  # type: ignore[arg-type]
        n = len(prompts)
        sps = _as_list(obj.sampling_params or SGLSamplingParams(), n, "sampling_params")
        if obj.rid is not None:
            rids = _as_list(obj.rid, n, "rid")
        else:
            rids = [uuid.uuid4().hex for _ in prompts]
        want_lp = _as_list(obj.return_logprob, n, "return_logprob")
        requests = []
        for p, sp, rid, lp in zip(prompts, sps, rids, want_lp, strict=True):
            outputs = {
                "top_logprobs": obj.top_logprobs_num if lp else 0,
                "prompt_logprobs": obj.top_logprobs_num if lp and obj.logprob_start_len >= 0
                else None,
                "return_routed_experts": obj.return_routed_experts,
            }  # fmt: skip
            requests.append(GenerateRequest(p, sp.to_params(state.default_max_new, **outputs), rid))
        state.check_batch(requests)

        def output(i: int, c: Completion) -> dict[str, Any]:
            group_n = requests[i].params.n
            sample_rid = rids[i] if group_n == 1 else f"{rids[i]}_{c.index}"  # as SGLang
            routed, shape = state.routed(c, obj.routed_experts_start_len)
            return generate_output(c, sample_rid, obj, want_lp[i], state.token_text,
                                   engine.version, routed, shape,
                                   state.versions.label)  # fmt: skip

        if obj.stream:
            state.runner.validate(requests)  # a 4xx, before the stream answers 200
            return StreamingResponse(_sglang_stream(state, requests, output),
                                     media_type="text/event-stream")  # fmt: skip
        groups = await state.runner.run(request, requests)
        outs = [output(i, c) for i, group in enumerate(groups) for c in group]
        return outs if (batched or len(outs) > 1) else outs[0]

    add_openai_routes(app, state)
    weight_routes = add_weight_routes(app, state, options.weight_sync_timeout_s)
    return app


async def _sglang_stream(state: ServerState, requests: list[GenerateRequest], output: Any) -> Any:
    """SGLang's default (non-incremental) streaming: every event carries the sample's text and
    output ids so far and its meta_info (finish_reason null until the last); `index` numbers
    the samples (prompt-major); ends with [DONE]."""
    texts: dict[tuple[int, int], TextStream] = {}
    ids: dict[tuple[int, int], list[int]] = {}
    lps: dict[tuple[int, int], list[float]] = {}
    offsets = [sum(r.params.n for r in requests[:i]) for i in range(len(requests))]
    try:
        async for i, ev in state.runner.stream(requests):
            key = (i, ev.index)
            ts = texts.setdefault(key, TextStream(state.decode(), requests[i].params.stop))
            if ev.completion is not None:
                ts.finish(ev.completion)
                out = output(i, ev.completion)
            else:
                ts.push(ev.token_id)
                ids.setdefault(key, []).append(ev.token_id)
                lps.setdefault(key, []).append(ev.logprob)
                partial = Completion(requests[i].request_id, ev.index, requests[i].prompt_ids,
                                     ids[key], ts.sent, lps[key], "abort", [])  # fmt: skip
                out = output(i, partial)
                out["text"] = ts.sent
                out["meta_info"]["finish_reason"] = None
                out["meta_info"]["output_token_versions"] = None
            out["index"] = offsets[i] + ev.index
            yield sse(out)
    except (RuntimeError, ValueError) as e:
        yield sse(error_body(500, f"engine error: {e}"))
    yield sse("[DONE]")


class EngineEndpoint:
    """An in-process engine served over HTTP (the full `create_app`: SGLang's endpoints, the
    weight routes of engine/weight_routes.py included) from a background thread on `host` and a
    free port, every endpoint but /health behind `api_key`: how a rollout worker's native engine takes weight pushes
    (engine.weight_sync = distributed). `url` once constructed; `close()` stops it."""

    def __init__(self, engine: Any, tokenizer: Any, *, timeout_s: float, api_key: str,
                 host: str = "127.0.0.1", start_timeout_s: float = 60.0) -> None:  # fmt: skip
        import uvicorn

        # every endpoint behind the key: other users of the machine can reach loopback too
        options = ServeOptions(served_model_name="rollout-engine", api_key=api_key,
                               api_key_scope="all", weight_sync_timeout_s=timeout_s)  # fmt: skip
        app = create_app(engine, tokenizer, options=options)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, 0))
        self.url = f"http://{host}:{self.sock.getsockname()[1]}"
        config = uvicorn.Config(app, log_level="warning", lifespan="off")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       daemon=True, name="engine-endpoint")  # fmt: skip
        self.thread.start()
        deadline = time.monotonic() + start_timeout_s
        while not self.server.started:  # a condition the server sets, polled
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"engine endpoint on {self.url} did not start")
            time.sleep(0.01)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()
