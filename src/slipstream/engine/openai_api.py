"""OpenAI-compatible endpoints of the HTTP server: GET /v1/models (and /v1/models/{id}),
POST /v1/completions and POST /v1/chat/completions, non-streaming and streaming.

Prompts given as text are encoded as the tokenizer defines it (`Tokenizer.encode_prompt`: the
post-processor adds BOS for slipstream's char vocabulary, the way a transformers tokenizer
loaded from the checkpoint does); chat messages go through the tokenizer's chat template
(`Tokenizer.chat_prompt`). The `model` field must name the served model (`--served-model-name`,
default the model directory's name) or be omitted; another name is 404.

Streaming (`stream: true`) sends server-sent events: one chunk per generated token (chunks whose
text delta is empty are skipped unless logprobs were asked for), a final chunk per choice with
its finish_reason and the rest of its text, a usage chunk (`choices: []`) when
`stream_options.include_usage` is true, then `data: [DONE]`. The concatenated deltas of a choice
equal its non-streamed text (`streaming.TextStream`). A client that disconnects has its
requests aborted.

Choices carry slipstream extras `token_ids`, `token_versions` (and vLLM's `stop_reason`).
Logprob semantics: see `openai_protocol.py`. Not covered: tools/function calling, response
formats other than text, suffix, best_of > n, logit_bias, penalties, multimodal content.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from slipstream.engine.base import Completion, GenerateRequest, SamplingParams, StreamEvent
from slipstream.engine.guard import error_body
from slipstream.engine.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    chat_logprob_entries,
    completion_logprobs,
)
from slipstream.engine.protocol import finite
from slipstream.engine.streaming import TextStream, sse

if TYPE_CHECKING:
    from slipstream.engine.server_state import ServerState


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}  # fmt: skip


def _with_sampled(
    tops: list[list[tuple[int, float]]] | None, tokens: list[int], logprobs: list[float]
) -> list[list[tuple[int, float]]] | None:
    """Completions' top_logprobs also hold the sampled token (OpenAI: up to logprobs + 1)."""
    if tops is None:
        return None
    out = []
    for alts, tok, lp in zip(tops, tokens, logprobs, strict=True):
        out.append(alts if any(t == tok for t, _ in alts) else [*alts, (tok, lp)])
    return out


def _finite_all(values: list[float | None]) -> list[float | None]:
    return [finite(v) for v in values]


def _finite_tops(tops: Any) -> Any:
    if tops is None:
        return None
    return [None if a is None else [(t, finite(lp)) for t, lp in a] for a in tops]


def add_openai_routes(app: FastAPI, state: ServerState) -> None:
    """Register the /v1 endpoints on `app`."""
    engine, options = state.engine, state.options

    def model_card() -> dict[str, Any]:
        return {"id": options.served_model_name, "object": "model", "created": state.created,
                "owned_by": "slipstream", "root": options.served_model_name,
                "max_model_len": engine.max_seq_len}  # fmt: skip

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        state.check_model(model_id)
        return model_card()

    def checked(obj: CompletionRequest | ChatCompletionRequest) -> None:
        state.check_model(obj.model)
        bad = obj.unsupported()
        if bad:
            raise ValueError(f"{bad[0]} is not supported by slipstream's server")

    @app.post("/v1/completions")
    async def completions(obj: CompletionRequest, request: Request) -> Any:
        checked(obj)
        p = obj.prompt
        state.check_prompt_count(len(p) if p and isinstance(p[0], (str, list)) else 1)
        if isinstance(p, str):
            texts: list[str | None] = [p]
        elif p and isinstance(p[0], str):
            texts = list(p)  # type: ignore[arg-type]
        else:
            texts = []
        if texts:
            prompts = [state.encode(t) for t in texts]  # type: ignore[arg-type]
        elif p and isinstance(p[0], list):
            prompts, texts = [list(x) for x in p], [None] * len(p)  # type: ignore[arg-type]
        else:
            prompts, texts = [list(p)], [None]  # type: ignore[arg-type]
        if any(not ids for ids in prompts):
            raise ValueError("prompt is empty")
        top_n = obj.logprobs or 0
        params = SamplingParams(
            max_new_tokens=state.default_max_new if obj.max_tokens is None else obj.max_tokens,
            top_logprobs=top_n,
            prompt_logprobs=top_n if obj.echo and obj.logprobs is not None else None,
            **obj.sampling_kwargs(),
        )
        cid = f"cmpl-{uuid.uuid4().hex}"
        requests = [GenerateRequest(ids, params, f"{cid}-{i}") for i, ids in enumerate(prompts)]
        state.check_batch(requests)

        def tok_str(t: int) -> str:
            return f"token_id:{t}" if obj.return_tokens_as_token_ids else state.token_text(t)

        def echo_text(i: int) -> str:
            text = texts[i]
            return text if text is not None else state.text_of(prompts[i])

        head = {"id": cid, "object": "text_completion", "created": int(time.time()),
                "model": options.served_model_name}  # fmt: skip
        if obj.stream:
            return StreamingResponse(
                _completion_stream(state, obj, requests, head, tok_str, echo_text),
                media_type="text/event-stream",
            )
        groups = await state.runner.run(request, requests)
        choices, completion_tokens = [], 0
        for i, group in enumerate(groups):
            for c in group:
                completion_tokens += len(c.token_ids)
                logprobs = None
                if obj.logprobs is not None:
                    tops = _with_sampled(c.top_logprobs if top_n else None, c.token_ids,
                                         c.logprobs)  # fmt: skip
                    ids, lps = c.token_ids, list(c.logprobs)
                    if obj.echo:
                        ptop = c.prompt_top_logprobs if top_n else None
                        ids = c.prompt_ids + ids
                        lps = list(c.prompt_logprobs or [None] * len(c.prompt_ids)) + lps
                        if tops is not None:
                            tops = list(ptop or [None] * len(c.prompt_ids)) + tops
                    logprobs = completion_logprobs(ids, _finite_all(lps), _finite_tops(tops),
                                                   tok_str)  # fmt: skip
                text = (echo_text(i) if obj.echo else "") + c.text
                choices.append({
                    "index": len(choices), "text": text, "logprobs": logprobs,
                    "finish_reason": c.finish_reason, "stop_reason": c.matched_stop,
                    "matched_stop": c.matched_stop, "token_ids": c.token_ids,
                    "token_versions": c.versions,
                })  # fmt: skip
        prompt_tokens = sum(len(ids) for ids in prompts)
        return {**head, "choices": choices, "usage": _usage(prompt_tokens, completion_tokens)}

    @app.post("/v1/chat/completions")
    async def chat_completions(obj: ChatCompletionRequest, request: Request) -> Any:
        checked(obj)
        if state.tokenizer is None:
            raise ValueError("this server has no tokenizer: chat completions need one")
        messages = []
        for m in obj.messages:
            msg: dict[str, Any] = {"role": m.role, "content": m.text()}
            if m.name is not None:
                msg["name"] = m.name
            messages.append(msg)
        ids = state.tokenizer.chat_prompt(messages, obj.add_generation_prompt)
        top_n = (obj.top_logprobs or 0) if obj.logprobs else 0
        params = SamplingParams(max_new_tokens=obj.max_new_tokens(state.default_max_new),
                                top_logprobs=top_n, **obj.sampling_kwargs())  # fmt: skip
        cid = f"chatcmpl-{uuid.uuid4().hex}"
        requests = [GenerateRequest(ids, params, cid)]
        state.check_batch(requests)
        head = {"id": cid, "created": int(time.time()), "model": options.served_model_name}
        if obj.stream:
            return StreamingResponse(_chat_stream(state, obj, requests, head),
                                     media_type="text/event-stream")  # fmt: skip
        (group,) = await state.runner.run(request, requests)
        choices = []
        for c in group:
            logprobs = None
            if obj.logprobs:
                entries = chat_logprob_entries(c.token_ids, _finite_all(c.logprobs),
                                               _finite_tops(c.top_logprobs) if top_n else None,
                                               state.token_text)  # fmt: skip
                logprobs = {"content": entries, "refusal": None}
            choices.append({
                "index": c.index, "message": {"role": "assistant", "content": c.text},
                "logprobs": logprobs, "finish_reason": c.finish_reason,
                "stop_reason": c.matched_stop, "token_ids": c.token_ids,
                "token_versions": c.versions,
            })  # fmt: skip
        usage = _usage(len(ids), sum(len(c.token_ids) for c in group))
        return {**head, "object": "chat.completion", "choices": choices, "usage": usage}


async def _completion_stream(
    state: ServerState,
    obj: CompletionRequest,
    requests: list[GenerateRequest],
    head: dict[str, Any],
    tok_str: Any,
    echo_text: Any,
) -> AsyncIterator[bytes]:
    offsets = [sum(r.params.n for r in requests[:i]) for i in range(len(requests))]
    streams: dict[int, TextStream] = {}
    text_pos: dict[int, int] = {}
    echoed: set[int] = set()
    want_lp, top_n = obj.logprobs is not None, obj.logprobs or 0
    completion_tokens = 0

    def chunk(index: int, text: str, logprobs: Any, finish: str | None) -> bytes:
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
        return sse({**head, "choices": [choice]})

    def lp_obj(index: int, ids: list[int], lps: list[Any], tops: Any) -> dict[str, Any]:
        out = completion_logprobs(ids, _finite_all(lps), _finite_tops(tops), tok_str,
                                  text_pos.get(index, 0))  # fmt: skip
        text_pos[index] = text_pos.get(index, 0) + sum(len(t) for t in out["tokens"])
        return out

    def echo_chunk(i: int, index: int, ev: StreamEvent) -> bytes:
        echoed.add(index)
        c = ev.completion
        plps = ev.prompt_logprobs if c is None else c.prompt_logprobs
        ptop = ev.prompt_top_logprobs if c is None else c.prompt_top_logprobs
        logprobs = None
        if want_lp:
            prompt = requests[i].prompt_ids
            tops = (ptop or [None] * len(prompt)) if top_n else None
            logprobs = lp_obj(index, prompt, list(plps or [None] * len(prompt)), tops)
        return chunk(index, echo_text(i), logprobs, None)

    try:
        async for i, ev in state.runner.stream(requests):
            index = offsets[i] + ev.index
            ts = streams.setdefault(index, TextStream(state.decode(), requests[i].params.stop))
            if obj.echo and index not in echoed:
                yield echo_chunk(i, index, ev)
            c: Completion | None = ev.completion
            if c is not None:
                completion_tokens += len(c.token_ids)
                yield chunk(index, ts.finish(c), None, c.finish_reason)
                continue
            delta = ts.push(ev.token_id)
            logprobs = None
            if want_lp:
                tops = _with_sampled([ev.top_logprobs or []], [ev.token_id], [ev.logprob])
                logprobs = lp_obj(index, [ev.token_id], [ev.logprob], tops if top_n else None)
            if delta or want_lp:
                yield chunk(index, delta, logprobs, None)
    except (RuntimeError, ValueError) as e:
        yield sse(error_body(500, f"engine error: {e}"))
    else:
        if obj.stream_options is not None and obj.stream_options.include_usage:
            prompt_tokens = sum(len(r.prompt_ids) for r in requests)
            yield sse({**head, "choices": [], "usage": _usage(prompt_tokens, completion_tokens)})
    yield sse("[DONE]")


async def _chat_stream(
    state: ServerState,
    obj: ChatCompletionRequest,
    requests: list[GenerateRequest],
    head: dict[str, Any],
) -> AsyncIterator[bytes]:
    head = {**head, "object": "chat.completion.chunk"}
    (req,) = requests
    streams = {i: TextStream(state.decode(), req.params.stop) for i in range(req.params.n)}
    top_n = req.params.top_logprobs
    completion_tokens = 0

    def chunk(index: int, delta: dict[str, Any], logprobs: Any, finish: str | None) -> bytes:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return sse({**head, "choices": [choice]})

    for i in range(req.params.n):
        yield chunk(i, {"role": "assistant", "content": ""}, None, None)
    try:
        async for _, ev in state.runner.stream(requests):
            ts = streams[ev.index]
            c = ev.completion
            if c is not None:
                completion_tokens += len(c.token_ids)
                rest = ts.finish(c)
                yield chunk(ev.index, {"content": rest} if rest else {}, None, c.finish_reason)
                continue
            delta = ts.push(ev.token_id)
            logprobs = None
            if obj.logprobs:
                tops = [_finite_tops([ev.top_logprobs or []])[0]] if top_n else None
                entries = chat_logprob_entries([ev.token_id], [finite(ev.logprob)], tops,
                                               state.token_text)  # fmt: skip
                logprobs = {"content": entries, "refusal": None}
            if delta or obj.logprobs:
                yield chunk(ev.index, {"content": delta}, logprobs, None)
    except (RuntimeError, ValueError) as e:
        yield sse(error_body(500, f"engine error: {e}"))
    else:
        if obj.stream_options is not None and obj.stream_options.include_usage:
            usage = _usage(len(req.prompt_ids), completion_tokens)
            yield sse({**head, "choices": [], "usage": usage})
    yield sse("[DONE]")
