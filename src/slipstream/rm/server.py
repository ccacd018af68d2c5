"""The reward model over HTTP, in the shape vLLM and SGLang serve classification / reward models:
POST /classify (and /v1/classify), `slipstream serve --model RM_DIR` when RM_DIR is a
sequence-classification checkpoint.

Request (vLLM's ClassificationRequest; SGLang's /v1/classify is the same):
    {"model": "rm", "input": "text" | ["text", ...] | [[token ids], ...]}
Response:
    {"id": "classify-...", "object": "list", "created": 1733380000, "model": "rm",
     "data": [{"index": 0, "label": "LABEL_0", "probs": [0.73], "num_classes": 1,
               "logits": [0.99]}, ...],
     "usage": {"prompt_tokens": 42, "total_tokens": 42, "completion_tokens": 0}}

With one label vLLM's `probs` is sigmoid(logit); `logits` (the raw reward, what transformers'
`AutoModelForSequenceClassification(...).logits` gives) is slipstream's addition. A text is
scored as `tokenizer.encode_prompt(text)` (BOS + text, as `AutoTokenizer(text).input_ids`).
All of a request's inputs are one scoring call (batches of `max_batch`, sorted by length);
concurrent requests take turns on the model (one lock), so batching across groups is the
client's (`rm/source.py` coalesces a worker's completions into one request).

Also: GET /health, GET /v1/models, GET /get_model_info. Errors in OpenAI's shape (400 for a bad
input, 401/413 from the guard: `--api-key`, `--max-request-bytes` as for the engine server).
Not covered: /pooling, /score (cross-encoder pairs), /rerank, multi-label classifiers.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict

from slipstream.engine.guard import GuardMiddleware, ServeOptions, error_response
from slipstream.model.tokenizer import Tokenizer
from slipstream.rm.model import MoERewardModel, score_ids
from slipstream.rm.source import sigmoid


class ClassifyRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    input: str | list[str] | list[list[int]]
    user: str | None = None


def create_reward_app(
    rm: MoERewardModel,
    tokenizer: Tokenizer,
    options: ServeOptions,
    max_batch: int = 64,
) -> FastAPI:
    """The FastAPI app scoring with `rm` (see the module docstring)."""
    app = FastAPI(title="slipstream reward model server")
    app.add_middleware(GuardMiddleware, options=options)
    lock = threading.Lock()
    name = options.served_model_name
    max_pos = rm.config.max_position_embeddings
    vocab = rm.config.vocab_size

    @app.exception_handler(RequestValidationError)
    async def _bad_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        e = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid"}
        loc = ".".join(str(p) for p in e["loc"] if p != "body")
        return error_response(400, f"invalid request: {loc}: {e['msg']}", loc or None)

    def _ids(req: ClassifyRequest) -> list[list[int]]:
        inputs: list[Any] = [req.input] if isinstance(req.input, str) else list(req.input)
        if not inputs:
            raise ValueError("input is empty")
        if len(inputs) > options.max_batch_samples:
            raise ValueError(f"{len(inputs)} inputs; at most {options.max_batch_samples}")
        for i, x in enumerate(inputs):  # "" would score BOS alone: a reward for nothing
            if not x or (isinstance(x, str) and not x.strip()):
                raise ValueError(f"input[{i}] is empty")
        seqs = [tokenizer.encode_prompt(x) if isinstance(x, str) else list(x) for x in inputs]
        for i, s in enumerate(seqs):
            if not s:
                raise ValueError(f"input[{i}] has no tokens")
            if len(s) > max_pos:
                raise ValueError(
                    f"input[{i}] has {len(s)} tokens; the model's context is {max_pos}"
                )
            if min(s) < 0 or max(s) >= vocab:
                raise ValueError(f"input[{i}] has a token id outside [0, {vocab})")
        return seqs

    def _score(seqs: list[list[int]]) -> list[float]:
        with lock:
            return score_ids(rm, seqs, tokenizer.pad_id, max_batch)

    @app.post("/classify")
    @app.post("/v1/classify")
    async def classify(req: ClassifyRequest) -> Any:
        try:
            seqs = _ids(req)
        except ValueError as e:
            return error_response(400, str(e), "input")
        logits = await asyncio.to_thread(_score, seqs)
        tokens = sum(len(s) for s in seqs)
        data = [
            {"index": i, "label": "LABEL_0", "probs": [sigmoid(x)], "num_classes": 1,
             "logits": [x]}
            for i, x in enumerate(logits)
        ]  # fmt: skip
        return {
            "id": f"classify-{uuid.uuid4().hex}",
            "object": "list",
            "created": int(time.time()),
            "model": name,
            "data": data,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0},
        }

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": name, "object": "model", "owned_by": "slipstream",
                                            "max_model_len": max_pos}]}  # fmt: skip

    @app.get("/get_model_info")
    async def model_info() -> dict[str, Any]:
        return {"model_path": name, "is_generation": False, "num_labels": 1,
                "architectures": ["Qwen3MoeForSequenceClassification"]}  # fmt: skip

    return app


def serve_reward_model(
    model_dir: str, tokenizer_spec: str | None, options: ServeOptions, device: str, host: str,
    port: int, log_level: str,
) -> int:  # fmt: skip
    """`slipstream serve --model RM_DIR` for a sequence-classification checkpoint: load it, print
    one line, serve until stopped."""
    import uvicorn

    from slipstream.model.tokenizer import load_tokenizer
    from slipstream.rm.model import load_reward_model

    rm = load_reward_model(model_dir, device=device)
    tokenizer = load_tokenizer(tokenizer_spec or model_dir)
    app = create_reward_app(rm, tokenizer, options)
    print(f"slipstream serve: reward model {options.served_model_name} on http://{host}:{port} "
          "(POST /classify)", flush=True)  # fmt: skip
    uvicorn.run(app, host=host, port=port, log_level=log_level)
    return 0
