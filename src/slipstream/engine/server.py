"""HTTP server over the native engine: SGLang's native API subset plus OpenAI `/v1/completions`.

Endpoints: POST /generate, POST /update_weights_from_disk, POST|GET /flush_cache, POST
/abort_request, GET /get_model_info, GET /health, GET /health_generate, POST /v1/completions,
GET /v1/models. Concurrent requests share the engine's running batch (continuous batching).

Errors: a request that cannot run (bad field, unsupported option, prompt too long) gets 400 with
{"error": {"message": ...}}; the server keeps serving. Not covered: streaming, top-n logprobs,
input logprobs, chat completions, authentication.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from slipstream.engine.base import Completion, GenerateRequest, SamplingParams
from slipstream.engine.native import NativeEngine
from slipstream.engine.protocol import (
    AbortReqInput,
    CompletionRequest,
    GenerateReqInput,
    SGLSamplingParams,
    UpdateWeightFromDiskReqInput,
    generate_output,
)


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "code": status}}, status_code=status)


def _as_list(value: Any, n: int, name: str) -> list[Any]:
    if isinstance(value, list):
        if len(value) != n:
            raise ValueError(f"{name} has {len(value)} entries for {n} prompts")
        return value
    return [value] * n


def create_app(engine: NativeEngine, tokenizer: Any = None, model_path: str = "") -> FastAPI:
    """The FastAPI app serving `engine`. `tokenizer` encodes `text` prompts and decodes texts."""
    app = FastAPI(title="slipstream engine server")
    default_max_new = engine.config.max_new_tokens

    @app.exception_handler(RequestValidationError)
    async def _bad_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        parts = [
            f"{'.'.join(str(p) for p in e['loc'] if p != 'body')}: {e['msg']}" for e in exc.errors()
        ]
        return _error(400, "invalid request: " + "; ".join(parts))

    @app.exception_handler(ValueError)
    async def _bad_value(request: Request, exc: ValueError) -> JSONResponse:
        return _error(400, str(exc))

    def encode(text: str) -> list[int]:
        if tokenizer is None:
            raise ValueError("this server has no tokenizer: send input_ids instead of text")
        return tokenizer.encode(text)

    def token_text(tok: int) -> str | None:
        return tokenizer.decode([tok]) if tokenizer is not None else None

    async def run(requests: list[GenerateRequest]) -> list[list[Completion]]:
        for r in requests:  # ValueError -> 400 before any of them runs
            engine.validate(r)
        futures = [engine.submit(r) for r in requests]
        return list(await asyncio.gather(*(asyncio.wrap_future(f) for f in futures)))

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate() -> Response:
        probe = GenerateRequest([0], SamplingParams(max_new_tokens=1, temperature=0.7))
        try:
            await asyncio.wait_for(run([probe]), timeout=60)
        except (RuntimeError, TimeoutError):
            return Response(status_code=503)
        return Response(status_code=200)

    @app.get("/get_model_info")
    async def get_model_info() -> dict[str, Any]:
        return {
            "model_path": model_path,
            "tokenizer_path": model_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": str(engine.version),
        }

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
        if obj.load_format not in (None, "auto", "safetensors"):
            return _error(
                400, f"load_format {obj.load_format!r} is not supported (safetensors only)"
            )
        try:
            version = engine.version + 1 if obj.weight_version is None else int(obj.weight_version)
        except ValueError:
            return _error(400, f"weight_version {obj.weight_version!r} is not an integer")
        if "://" not in obj.model_path and not Path(obj.model_path).is_dir():
            content = {
                "success": False,
                "message": f"{obj.model_path} is not a directory",
                "num_paused_requests": 0,
            }
            return JSONResponse(content, status_code=400)
        if obj.abort_all_requests:
            engine.abort_all()
        try:
            await asyncio.to_thread(engine.update_weights, version, obj.model_path)
        except (ValueError, OSError, RuntimeError) as e:
            content = {"success": False, "message": f"update failed: {e}", "num_paused_requests": 0}
            return JSONResponse(content, status_code=400)
        message = f"Succeeded to update model weights (version {version})."
        return JSONResponse({"success": True, "message": message, "num_paused_requests": 0})

    @app.post("/generate")
    async def generate(obj: GenerateReqInput) -> Any:
        if obj.stream:
            return _error(400, "stream=True is not supported by slipstream's server")
        if (obj.text is None) == (obj.input_ids is None):
            return _error(400, "give exactly one of text or input_ids")
        if obj.text is not None:
            batched = isinstance(obj.text, list)
            prompts = [encode(t) for t in (obj.text if batched else [obj.text])]
        else:
            ids = obj.input_ids or []
            batched = bool(ids) and isinstance(ids[0], list)
            prompts = [list(p) for p in ids] if batched else [list(ids)]  # type: ignore[arg-type]
        n = len(prompts)
        sps = _as_list(obj.sampling_params or SGLSamplingParams(), n, "sampling_params")
        rids = (
            _as_list(obj.rid, n, "rid")
            if obj.rid is not None
            else [uuid.uuid4().hex for _ in prompts]
        )
        want_lp = _as_list(obj.return_logprob, n, "return_logprob")
        requests = [
            GenerateRequest(p, sp.to_params(default_max_new), rid)
            for p, sp, rid in zip(prompts, sps, rids, strict=True)
        ]
        groups = await run(requests)
        outs = []
        for rid, lp, group in zip(rids, want_lp, groups, strict=True):
            for c in group:
                sample_rid = rid if len(group) == 1 else f"{rid}_{c.index}"  # as SGLang
                outs.append(generate_output(c, sample_rid, lp, token_text, engine.version))
        return outs if (batched or len(outs) > 1) else outs[0]

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [{"id": model_path, "object": "model", "owned_by": "slipstream"}],
        }

    @app.post("/v1/completions")
    async def completions(obj: CompletionRequest) -> dict[str, Any]:
        params = obj.to_params(default_max_new)
        p = obj.prompt
        if isinstance(p, str):
            prompts = [encode(p)]
        elif p and isinstance(p[0], str):
            prompts = [encode(t) for t in p]  # type: ignore[arg-type]
        elif p and isinstance(p[0], list):
            prompts = [list(x) for x in p]  # type: ignore[arg-type]
        else:
            prompts = [list(p)]  # type: ignore[arg-type]
        groups = await run([GenerateRequest(ids, params) for ids in prompts])
        choices, completion_tokens = [], 0
        for group in groups:
            for c in group:
                completion_tokens += len(c.token_ids)
                logprobs = None
                if obj.logprobs is not None:
                    texts = [
                        f"token_id:{t}" if obj.return_tokens_as_token_ids else (token_text(t) or "")
                        for t in c.token_ids
                    ]
                    offsets, pos = [], 0
                    for t in texts:
                        offsets.append(pos)
                        pos += len(t)
                    logprobs = {
                        "tokens": texts,
                        "token_logprobs": c.logprobs,
                        "top_logprobs": None,
                        "text_offset": offsets,
                    }
                choices.append(
                    {
                        "index": len(choices),
                        "text": c.text,
                        "logprobs": logprobs,
                        "finish_reason": c.finish_reason,
                        "matched_stop": c.matched_stop,
                        "token_ids": c.token_ids,
                        "token_versions": c.versions,
                    }
                )
        prompt_tokens = sum(len(ids) for ids in prompts)
        return {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": obj.model or model_path,
            "choices": choices,
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
            },
        }

    return app
