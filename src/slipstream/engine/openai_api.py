"""OpenAI-compatible endpoints of the HTTP server: GET /v1/models (and /v1/models/{id}),
POST /v1/completions and POST /v1/chat/completions, non-streaming and streaming.

Prompts given as text are encoded as the tokenizer defines it (`Tokenizer.encode_prompt`: the
post-processor adds BOS for slipstream's char vocabulary, the way a transformers tokenizer
loaded from the checkpoint does); chat messages go through the tokenizer's chat template
(`Tokenizer.chat_prompt`). The `model` field must name the served model (`--served-model-name`,
default the model directory's name) or be omitted; another name is 404.

Streaming (`stream: true`) sends server-sent events: one chunk per generated token (chunks whose
text delta is empty are skipped unless logprobs were asked for), the last token's chunk carrying
its choice's finish_reason (and the rest of the text held back), an echoed prompt merged into the
first token's chunk, so a stream has at most one chunk per token (vLLM's framing; `_Framing`);
with `stream_options.include_usage` a usage chunk (`choices: []`), and with
`continuous_usage_stats` too, each chunk's usage so far; then `data: [DONE]`. `stream_options`
without `stream` is a 400. The concatenated deltas of a choice
equal its non-streamed text (`streaming.TextStream`). A client that disconnects has its
requests aborted.

Choices carry slipstream extras `token_ids`, `token_versions` (and vLLM's `stop_reason`), and
with `return_routed_experts` the MoE routing as `/generate` has it (`routed_experts`, base64
int32 of the P + C - 1 input positions, and `routed_experts_layout`; streamed on the choice's
last chunk).
Logprob semantics: see `openai_protocol.py`. Not covered: tools/function calling, response
formats other than text, suffix, best_of > n, logit_bias, penalties, multimodal content.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable
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


def _usage(prompt_tokens: int, completion_tokens: int, cached: int | None = None) -> dict[str, Any]:
    """OpenAI usage; `cached`: prompt tokens served from the prefix cache (its
    `prompt_tokens_details.cached_tokens`), on the final usage objects of a server started with
    `--enable-prompt-tokens-details` (vLLM omits the field otherwise)."""
    out: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                           "total_tokens": prompt_tokens + completion_tokens}  # fmt: skip
    if cached is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached}
    return out


def _cached(groups: list[list[Completion]]) -> int:
    """Prompt tokens served from the prefix cache, per prompt (its group's first sample)."""
    return sum(g[0].meta.get("cached_tokens", 0) for g in groups if g)


def _with_sampled(
    tops: list[list[tuple[int, float]] | None] | None,
    tokens: list[int],
    logprobs: list[float | None],
) -> list[list[tuple[int, float]] | None]:
    """Completions' top_logprobs per position: the position's own token first, then the raw
    top-n without it (none when n = 0): vLLM's n or n + 1 entries, its own token the first key
    (logprobs=0 gives one). A position without a logprob (the first prompt token) has None."""
    alts_of = tops if tops is not None else [[] for _ in tokens]
    out: list[list[tuple[int, float]] | None] = []
    for alts, tok, lp in zip(alts_of, tokens, logprobs, strict=True):
        if lp is None:
            out.append(None)
            continue
        out.append([(tok, lp), *((t, a) for t, a in alts or [] if t != tok)])
    return out


def _most(a: int | None, b: int | None) -> int | None:
    """The larger of two optional prompt-logprob widths (None: not asked for)."""
    return b if a is None else (a if b is None else max(a, b))


def _first_n(tops: Any, n: int) -> Any:
    """Each position's first n alternatives (None positions stay None)."""
    return None if tops is None else [None if a is None else a[:n] for a in tops]


def _token_str(state: ServerState, obj: CompletionRequest | ChatCompletionRequest) -> Any:
    """How logprob entries name a token: its text, or vLLM's "token_id:N"."""
    if obj.return_tokens_as_token_ids:
        return lambda t: f"token_id:{t}"
    return state.token_text


def _vllm_prompt_logprobs(
    c: Completion, n: int | None, state: ServerState
) -> list[dict[str, dict[str, Any]] | None] | None:
    """vLLM's `prompt_logprobs`: per prompt position, {token id: {logprob, rank, decoded_token}}
    for the raw top-n and the prompt token itself (None at position 0). `rank` is the
    1-based position among the top-n; a prompt token outside them has rank null."""
    if n is None or c.prompt_logprobs is None:
        return None
    tops = _first_n(c.prompt_top_logprobs, n) or [None] * len(c.prompt_ids)
    out: list[dict[str, dict[str, Any]] | None] = []
    for tok, lp, alts in zip(c.prompt_ids, c.prompt_logprobs, tops, strict=True):
        if lp is None:
            out.append(None)
            continue
        entry = {str(t): {"logprob": finite(a), "rank": r + 1, "decoded_token": state.token_text(t)}
                 for r, (t, a) in enumerate(alts or [])}  # fmt: skip
        if str(tok) not in entry:
            entry[str(tok)] = {"logprob": finite(lp), "rank": None,
                               "decoded_token": state.token_text(tok)}  # fmt: skip
        out.append(entry)
    return out


def _routed(state: ServerState, c: Completion) -> dict[str, Any]:
    """A choice's `routed_experts` (SGLang's base64 int32 of all P + C - 1 input positions) and
    `routed_experts_layout`, when the request asked (`return_routed_experts`); else nothing."""
    data, layout = state.routed(c, 0)
    return {} if data is None else {"routed_experts": data, "routed_experts_layout": layout}


def _metadata(state: ServerState, groups: list[list[Completion]]) -> dict[str, Any]:
    """SGLang's response `metadata`: the weight version (label) of the newest token."""
    versions = [c.versions[-1] for g in groups for c in g if c.versions]
    return {"weight_version": state.versions.label(max(versions, default=state.engine.version))}


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
        if obj.stream_options is not None and not obj.stream:
            raise ValueError("stream_options can only be set when stream is true")
        bad = obj.unsupported()
        if bad:
            raise ValueError(f"{bad[0]} is not supported by slipstream's server")

    @app.post("/v1/completions")
    async def completions(obj: CompletionRequest, request: Request) -> Any:
        checked(obj)
        p = obj.prompt
        state.check_prompt_count(p)
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
        echo_lp = top_n if obj.echo and obj.logprobs is not None else None
        params = SamplingParams(
            max_new_tokens=state.default_max_new if obj.max_tokens is None else obj.max_tokens,
            top_logprobs=top_n,
            prompt_logprobs=_most(echo_lp, obj.prompt_logprobs),
            return_routed_experts=obj.return_routed_experts,
            **obj.sampling_kwargs(),
        )
        cid = f"cmpl-{uuid.uuid4().hex}"
        requests = [GenerateRequest(ids, params, f"{cid}-{i}") for i, ids in enumerate(prompts)]
        state.check_batch(requests)
        if obj.max_tokens is not None:
            state.check_context(requests, "max_tokens")
        else:
            requests = state.fit_context(requests)
        state.check_stop_token_ids(requests)
        tok_str = _token_str(state, obj)

        def echo_text(i: int) -> str:
            # A token-id prompt echoes every token, special ones included (vLLM).
            text = texts[i]
            return text if text is not None else state.text_of(prompts[i], skip_special=False)

        head = {"id": cid, "object": "text_completion", "created": int(time.time()),
                "model": options.served_model_name}  # fmt: skip
        if obj.stream:
            state.runner.validate(requests)  # a 4xx, before the stream answers 200
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
                                         list(c.logprobs))  # fmt: skip
                    ids, lps = c.token_ids, list(c.logprobs)
                    if obj.echo:
                        plps = list(c.prompt_logprobs or [None] * len(c.prompt_ids))
                        ptop = _first_n(c.prompt_top_logprobs, top_n) if top_n else None
                        tops = _with_sampled(ptop, c.prompt_ids, plps) + tops
                        ids, lps = c.prompt_ids + ids, plps + lps
                    logprobs = completion_logprobs(ids, _finite_all(lps), _finite_tops(tops),
                                                   tok_str)  # fmt: skip
                text = (echo_text(i) if obj.echo else "") + c.text
                choices.append({
                    "index": len(choices), "text": text, "logprobs": logprobs,
                    "finish_reason": c.finish_reason, "stop_reason": c.matched_stop,
                    "matched_stop": c.matched_stop, "token_ids": c.token_ids,
                    "token_versions": c.versions,
                    "prompt_logprobs": _vllm_prompt_logprobs(c, obj.prompt_logprobs, state),
                    **_routed(state, c),
                })  # fmt: skip
        prompt_tokens = sum(len(ids) for ids in prompts)
        usage = _usage(prompt_tokens, completion_tokens, state.prompt_details(_cached(groups)))
        return {**head, "choices": choices, "usage": usage,
                "metadata": _metadata(state, groups)}  # fmt: skip

    @app.post("/v1/chat/completions")
    async def chat_completions(obj: ChatCompletionRequest, request: Request) -> Any:
        checked(obj)
        if state.tokenizer is None:
            raise ValueError("this server has no tokenizer: chat completions need one")
        messages = [m.template_fields() for m in obj.messages]
        ids = state.tokenizer.chat_prompt(messages, obj.add_generation_prompt)
        top_n = (obj.top_logprobs or 0) if obj.logprobs else 0
        params = SamplingParams(max_new_tokens=obj.max_new_tokens(state.default_max_new),
                                top_logprobs=top_n, prompt_logprobs=obj.prompt_logprobs,
                                return_routed_experts=obj.return_routed_experts,
                                **obj.sampling_kwargs())  # fmt: skip
        cid = f"chatcmpl-{uuid.uuid4().hex}"
        requests = [GenerateRequest(ids, params, cid)]
        state.check_batch(requests)
        if obj.max_completion_tokens is not None:
            state.check_context(requests, "max_completion_tokens")
        elif obj.max_tokens is not None:
            state.check_context(requests, "max_tokens")
        else:
            requests = state.fit_context(requests)
        state.check_stop_token_ids(requests)
        tok_str = _token_str(state, obj)
        head = {"id": cid, "created": int(time.time()), "model": options.served_model_name}
        if obj.stream:
            state.runner.validate(requests)  # a 4xx, before the stream answers 200
            return StreamingResponse(_chat_stream(state, obj, requests, head, tok_str),
                                     media_type="text/event-stream")  # fmt: skip
        (group,) = await state.runner.run(request, requests)
        choices = []
        for c in group:
            logprobs = None
            if obj.logprobs:
                entries = chat_logprob_entries(c.token_ids, _finite_all(c.logprobs),
                                               _finite_tops(c.top_logprobs) if top_n else None,
                                               tok_str)  # fmt: skip
                logprobs = {"content": entries, "refusal": None}
            choices.append({
                "index": c.index, "message": {"role": "assistant", "content": c.text},
                "logprobs": logprobs, "finish_reason": c.finish_reason,
                "stop_reason": c.matched_stop, "matched_stop": c.matched_stop,
                "token_ids": c.token_ids, "token_versions": c.versions, **_routed(state, c),
            })  # fmt: skip
        usage = _usage(len(ids), sum(len(c.token_ids) for c in group),
                       state.prompt_details(_cached([group])))  # fmt: skip
        prompt_lps = _vllm_prompt_logprobs(group[0], obj.prompt_logprobs, state)
        return {**head, "object": "chat.completion", "choices": choices, "usage": usage,
                "metadata": _metadata(state, [group]), "prompt_logprobs": prompt_lps}  # fmt: skip


class _Framing:
    """Stream framing as vLLM/OpenAI send it: each choice's latest chunk is held until that
    choice's next event, so the finish_reason rides on the last token's chunk (no extra empty
    chunk: a stream has at most one chunk per token), and an echoed prompt is merged into the
    first token's chunk. With `stream_options.continuous_usage_stats` (and include_usage) every
    chunk carries its choice's usage so far (vLLM)."""

    def __init__(self, head: dict[str, Any], content: str, continuous_usage: bool) -> None:
        self.head = head
        self.content = content  # "text" (completions) or "delta" (chat)
        self.continuous_usage = continuous_usage
        self.held: dict[int, tuple[dict[str, Any], bool]] = {}  # index -> (choice, open)

    def send(self, choice: dict[str, Any]) -> bytes:
        """`choice` (with its "usage" key, dropped unless continuous usage) as one chunk."""
        usage = choice.pop("usage")
        body = {**self.head, "choices": [choice]}
        if self.continuous_usage:
            body["usage"] = usage
        return sse(body)

    def hold(self, choice: dict[str, Any], usage: dict[str, int], open_: bool = False) -> bytes:
        """Hold `choice` (its previous chunk is sent, or, when open, absorbs it)."""
        choice["usage"] = usage
        prev = self.held.pop(choice["index"], None)
        if prev is not None and prev[1]:  # an echo chunk: the first token joins it
            choice = _merged(prev[0], choice, self.content)
            prev = None
        self.held[choice["index"]] = (choice, open_)
        return self.send(prev[0]) if prev is not None else b""

    def finish(
        self, index: int, rest: str, c: Completion, usage: dict[str, int], extra: dict[str, Any]
    ) -> bytes:
        """The choice's last chunk: the held one (its last token's) with the rest of the text,
        the finish_reason and vLLM's stop_reason (and `extra` fields); a chunk of its own when
        nothing is held."""
        prev = self.held.pop(index, None)
        if prev is None:
            body: Any = rest if self.content == "text" else ({"content": rest} if rest else {})
            choice = {"index": index, self.content: body, "logprobs": None}
        else:
            choice = prev[0]
            if self.content == "text":
                choice["text"] += rest
            elif rest:
                choice["delta"] = {"content": choice["delta"].get("content", "") + rest}
        choice.update(finish_reason=c.finish_reason, stop_reason=c.matched_stop, usage=usage,
                      **extra)  # fmt: skip
        return self.send(choice)


def _merged(first: dict[str, Any], then: dict[str, Any], content: str) -> dict[str, Any]:
    """Completions chunk `first` (an echo) followed by `then` as one chunk."""
    out = dict(then)
    out["text"] = first["text"] + then["text"]
    a, b = first["logprobs"], then["logprobs"]
    if a is not None and b is not None:
        out["logprobs"] = {k: (None if a[k] is None and b[k] is None else
                               list(a[k] or [None] * len(a["tokens"])) +
                               list(b[k] or [None] * len(b["tokens"])))
                           for k in a}  # fmt: skip
    return out


def _stream_usage(obj: CompletionRequest | ChatCompletionRequest) -> tuple[bool, bool]:
    """(include_usage, continuous_usage_stats) as vLLM reads stream_options."""
    so = obj.stream_options
    if so is None or not so.include_usage:
        return False, False
    return True, so.continuous_usage_stats


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
    ntok: dict[int, int] = {}
    want_lp, top_n = obj.logprobs is not None, obj.logprobs or 0
    completion_tokens = 0
    cached = 0  # prompt tokens served from the prefix cache (first samples)
    include_usage, continuous = _stream_usage(obj)
    framing = _Framing(head, "text", continuous)

    def choice(index: int, text: str, logprobs: Any) -> dict[str, Any]:
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": None}

    def usage_of(i: int, index: int) -> dict[str, int]:
        return _usage(len(requests[i].prompt_ids), ntok.get(index, 0))

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
            lps = list(plps or [None] * len(prompt))
            logprobs = lp_obj(index, prompt, lps, _with_sampled(ptop if top_n else None, prompt,
                                                               lps))  # fmt: skip
        return framing.hold(choice(index, echo_text(i), logprobs), usage_of(i, index), True)

    try:
        async for i, ev in state.runner.stream(requests):
            index = offsets[i] + ev.index
            ts = streams.setdefault(index, TextStream(state.decode(), requests[i].params.stop))
            if obj.echo and index not in echoed and (out := echo_chunk(i, index, ev)):
                yield out
            c: Completion | None = ev.completion
            if c is not None:
                completion_tokens += len(c.token_ids)
                cached += c.meta.get("cached_tokens", 0) if c.index == 0 else 0
                ntok[index] = len(c.token_ids)
                yield framing.finish(index, ts.finish(c), c, usage_of(i, index), _routed(state, c))
                continue
            ntok[index] = ntok.get(index, 0) + 1
            delta = ts.push(ev.token_id)
            logprobs = None
            if want_lp:
                tops = _with_sampled([ev.top_logprobs or []], [ev.token_id], [ev.logprob])
                logprobs = lp_obj(index, [ev.token_id], [ev.logprob], tops)
            if (delta or want_lp) and (
                out := framing.hold(choice(index, delta, logprobs), usage_of(i, index))
            ):
                yield out
    except (RuntimeError, ValueError) as e:
        yield sse(error_body(500, f"engine error: {e}"))
    else:
        if include_usage:
            prompt_tokens = sum(len(r.prompt_ids) for r in requests)
            usage = _usage(prompt_tokens, completion_tokens, state.prompt_details(cached))
            yield sse({**head, "choices": [], "usage": usage})
    yield sse("[DONE]")


async def _chat_stream(
    state: ServerState,
    obj: ChatCompletionRequest,
    requests: list[GenerateRequest],
    head: dict[str, Any],
    tok_str: Callable[[int], str],
) -> AsyncIterator[bytes]:
    head = {**head, "object": "chat.completion.chunk"}
    (req,) = requests
    streams = {i: TextStream(state.decode(), req.params.stop) for i in range(req.params.n)}
    top_n = req.params.top_logprobs
    completion_tokens = 0
    cached = 0  # prompt tokens served from the prefix cache (first samples)
    ntok = dict.fromkeys(range(req.params.n), 0)
    include_usage, continuous = _stream_usage(obj)
    framing = _Framing(head, "delta", continuous)

    def usage_of(index: int) -> dict[str, int]:
        return _usage(len(req.prompt_ids), ntok[index])

    for i in range(req.params.n):
        first = {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                 "finish_reason": None, "usage": usage_of(i)}  # fmt: skip
        yield framing.send(first)
    try:
        async for _, ev in state.runner.stream(requests):
            ts = streams[ev.index]
            c = ev.completion
            if c is not None:
                completion_tokens += len(c.token_ids)
                cached += c.meta.get("cached_tokens", 0) if c.index == 0 else 0
                ntok[ev.index] = len(c.token_ids)
                yield framing.finish(ev.index, ts.finish(c), c, usage_of(ev.index),
                                     _routed(state, c))  # fmt: skip
                continue
            ntok[ev.index] += 1
            delta = ts.push(ev.token_id)
            logprobs = None
            if obj.logprobs:
                tops = [_finite_tops([ev.top_logprobs or []])[0]] if top_n else None
                entries = chat_logprob_entries([ev.token_id], [finite(ev.logprob)], tops,
                                               tok_str)  # fmt: skip
                logprobs = {"content": entries, "refusal": None}
            if delta or obj.logprobs:
                chunk = {"index": ev.index, "delta": {"content": delta}, "logprobs": logprobs,
                         "finish_reason": None}  # fmt: skip
                if out := framing.hold(chunk, usage_of(ev.index)):
                    yield out
    except (RuntimeError, ValueError) as e:
        yield sse(error_body(500, f"engine error: {e}"))
    else:
        if include_usage:
            usage = _usage(len(req.prompt_ids), completion_tokens, state.prompt_details(cached))
            yield sse({**head, "choices": [], "usage": usage})
    yield sse("[DONE]")
