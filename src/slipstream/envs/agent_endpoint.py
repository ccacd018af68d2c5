"""The episode endpoint: an OpenAI-compatible base URL per agent episode, served by the rollout
worker from its own engine, recording every call token for token.

    endpoint = AgentEndpoint(engine, tokenizer, temperature=1.0, max_turn_tokens=64)
    session = endpoint.open(max_calls=8, max_sampled_tokens=512)
    # the agent: OPENAI_BASE_URL=session.base_url OPENAI_API_KEY=session.api_key
    ...
    session.close()            # later calls are refused (410); session.calls is the record

One HTTP server (uvicorn, on a thread of its own, 127.0.0.1 and an ephemeral port) serves every
episode of a worker; an episode is a path prefix `/s/<id>/v1` and a bearer key of its own, so an
agent reaches only its own episode (a wrong key is 401, another episode's path 404).

A sandboxed agent (no network) gets its episode on a Unix socket of its own instead:
`session.serve_unix(path)` starts a second uvicorn server on the same event loop, for that
path alone, whose every request path is put under the episode's prefix (`/v1/models` there is
`/s/<id>/v1/models`): through that socket no other episode's path exists. It stops when the
session closes.

Routes under the prefix: `GET models`, `POST chat/completions`, `POST completions`, streaming or
not. Requests are parsed by the server's own models (engine/openai_protocol.py) and chat messages
rendered by the tokenizer's chat template (`Tokenizer.chat_prompt`, as `slipstream serve` does);
logprob objects are built by the same helpers. Differences from `slipstream serve`, all because
the calls are RL samples:

- Sampling is the run's, not the agent's: temperature is the rollout's and top_p/top_k/min_p
  are neutral (the trainer's importance ratios assume the behaviour policy the run configured);
  the agent's values are ignored. `n` must be 1 (each call is one step of one trajectory).
- `max_tokens` is capped by the turn cap and by what is left of the episode's token budget;
  a call past the episode's call or token budget is refused with 403 (not retried by the
  OpenAI SDK), and so is any call after the episode ended (410).
- Tools: a request's `tools` reach the chat template as its `tools` variable (as transformers'
  `apply_chat_template(tools=...)`); with tools (and `tool_choice` not "none"), tool calls in
  the completion in the Hermes format Qwen's templates define (`<tool_call>{"name": ...,
  "arguments": {...}}</tool_call>`) come back as the message's `tool_calls`, finish_reason
  "tool_calls". Messages reach the template as `slipstream serve` hands them (`template_fields`:
  any role, an assistant turn's `tool_calls`, a tool result's `tool_call_id`, as given).
  `tool_choice` "required" or naming a function is refused (400).
- A streamed response is sent when the call's generation ends (one chunk per token, as
  `slipstream serve` frames it): the engine protocol returns completions, not token events, so
  the time to the first chunk is the call's latency.

Every answered call is a `CallRecord`: the prompt ids exactly as the engine was fed them, the
`Completion` the engine returned (sampled ids, behaviour logprobs, per-token versions, routed
experts when recorded), and, for chat, the request's messages and the reply. Refused requests
(malformed, over a limit) are counted per session (`bad_requests`, `refused`), never recorded.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import reprlib
import secrets
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse

from slipstream.engine.base import Completion, Engine, GenerateRequest, SamplingParams
from slipstream.engine.guard import authorized, error_response
from slipstream.engine.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    chat_logprob_entries,
    completion_logprobs,
)
from slipstream.engine.streaming import TextStream, sse

log = logging.getLogger(__name__)

CallKind = Literal["chat", "completion"]


@dataclass
class CallRecord:
    """One answered call of an episode, as the engine saw it."""

    kind: CallKind
    prompt_ids: list[int]
    completion: Completion
    messages: list[dict[str, Any]] = field(default_factory=list)
    """The request's messages (chat calls), as rendered."""
    reply: dict[str, Any] = field(default_factory=dict)
    """The assistant message returned (chat calls)."""
    latency_s: float = 0.0


class SessionError(Exception):
    """A call the episode's session refuses (an HTTP status and a one-line message)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class EpisodeSession:
    """One episode's view of the endpoint: its base URL and key, its limits and its record."""

    def __init__(self, endpoint: AgentEndpoint, max_calls: int, max_sampled_tokens: int) -> None:
        self.id = uuid.uuid4().hex
        self.api_key = "sk-episode-" + secrets.token_urlsafe(24)
        self.base_url = f"{endpoint.url}/s/{self.id}/v1"
        self.max_calls = max_calls
        self.max_sampled_tokens = max_sampled_tokens
        self.calls: list[CallRecord] = []
        self.bad_requests = 0
        """Malformed requests answered with a 4xx (bad JSON, unknown fields, n > 1...)."""
        self.refused = 0
        """Calls refused for a spent budget or after the episode ended."""
        self.closed = False
        self._endpoint = endpoint
        self._lock = threading.Lock()
        self._inflight: set[str] = set()
        self._reserved = 0  # calls admitted, answered or not
        self._unix_server: Any = None

    def serve_unix(self, path: str) -> None:
        """Serve this episode alone on a Unix socket at `path` (module docstring); it stops
        when the session closes. Connections are accepted (queued) as soon as this returns."""
        server = self._endpoint.serve_unix(self.id, path)
        with self._lock:
            self._unix_server, closed = server, self.closed
        if closed:
            _stop(server)

    @property
    def sampled_tokens(self) -> int:
        return sum(len(c.completion.token_ids) for c in self.calls)

    def admit(self) -> int:
        """Admit one more call; -> the most tokens it may sample. SessionError when refused."""
        with self._lock:
            if self.closed:
                self.refused += 1
                raise SessionError(410, "this episode has ended; its endpoint takes no calls")
            if self._reserved >= self.max_calls:
                self.refused += 1
                raise SessionError(403, f"this episode's limit of {self.max_calls} model calls "
                                        "is spent")  # fmt: skip
            left = self.max_sampled_tokens - self.sampled_tokens
            if left < 1:
                self.refused += 1
                raise SessionError(403, f"this episode's budget of {self.max_sampled_tokens} "
                                        "sampled tokens is spent")  # fmt: skip
            self._reserved += 1
            return left

    def begin(self, request_id: str) -> None:
        with self._lock:
            if self.closed:
                raise SessionError(410, "this episode has ended; its endpoint takes no calls")
            self._inflight.add(request_id)

    def record(self, call: CallRecord) -> None:
        with self._lock:
            self._inflight.discard(call.completion.request_id)
            if not self.closed:
                self.calls.append(call)

    def forget(self, request_id: str) -> None:
        with self._lock:
            self._inflight.discard(request_id)

    def count_bad(self) -> None:
        with self._lock:
            self.bad_requests += 1

    def close(self) -> None:
        """End the episode: later calls are refused and calls in flight are aborted (their
        results are not recorded). Idempotent."""
        with self._lock:
            self.closed = True
            live = list(self._inflight)
            server, self._unix_server = self._unix_server, None
        for rid in live:
            self._endpoint.engine.abort(rid)
        if server is not None:
            _stop(server)
        self._endpoint._drop(self.id)


def _log_failure(done: Any) -> None:
    if not done.cancelled() and done.exception() is not None:
        log.error("an episode's Unix endpoint failed: %r", done.exception())


def _stop(server: Any) -> None:
    """Make a uvicorn server stop at its next tick (0.1 s) without waiting for connections:
    whatever a closed episode's agent still sends is refused or cut."""
    server.should_exit = True
    server.force_exit = True


class _EpisodePaths:
    """An ASGI app that serves `app` with every HTTP path put under `prefix` (one episode's
    Unix socket: `/v1/...` is `/s/<id>/v1/...`)."""

    def __init__(self, app: Any, prefix: str) -> None:
        self.app = app
        self.prefix = prefix

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            path = self.prefix + scope["path"]
            scope = {**scope, "path": path, "raw_path": path.encode()}
        await self.app(scope, receive, send)


class AgentEndpoint:
    """The worker's OpenAI-compatible server for its agent episodes (see the module docstring).
    Thread-safe; `open` starts the server on first use; `close` stops it."""

    def __init__(
        self,
        engine: Engine,
        tokenizer: Any,
        *,
        temperature: float = 1.0,
        max_turn_tokens: int = 64,
        context_tokens: int = 0,
        record_routing: bool = False,
        model_name: str = "policy",
        host: str = "127.0.0.1",
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.temperature = temperature
        self.max_turn_tokens = max_turn_tokens
        self.context_tokens = context_tokens
        self.record_routing = record_routing
        self.model_name = model_name
        self.host = host
        self.url = ""
        self.port = 0
        self._sessions: dict[str, EpisodeSession] = {}
        self._lock = threading.Lock()
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self._app: FastAPI | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    # ---- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        """Serve on host:ephemeral port from a thread of its own (idempotent)."""
        import uvicorn

        with self._lock:
            if self._server is not None:
                return
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self.host, 0))
            self.port = sock.getsockname()[1]
            self.url = f"http://{self.host}:{self.port}"
            self._app = self.app()
            config = uvicorn.Config(self._app, log_level="warning", access_log=False,
                                    timeout_keep_alive=30, lifespan="off")  # fmt: skip
            server = uvicorn.Server(config)
            self._server = server

            def serve() -> None:
                # as `server.run` does, keeping the loop: episodes' Unix servers run on it too
                with asyncio.Runner(loop_factory=config.get_loop_factory()) as runner:
                    self._loop = runner.get_loop()
                    runner.run(server.serve(sockets=[sock]))

            self._thread = threading.Thread(target=serve, daemon=True, name="agent-endpoint")
            self._thread.start()
        deadline = time.monotonic() + 30.0
        while not server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the agent endpoint's HTTP server did not start")
            time.sleep(0.01)

    def close(self) -> None:
        with self._lock:
            server, thread, self._server = self._server, self._thread, None
            sessions = list(self._sessions.values())
        for s in sessions:
            s.close()
        if server is not None:
            server.should_exit = True
        if thread is not None:
            thread.join(timeout=10.0)

    def open(self, *, max_calls: int, max_sampled_tokens: int) -> EpisodeSession:
        """A new episode's session (its own URL prefix and key)."""
        self.start()
        s = EpisodeSession(self, max_calls, max_sampled_tokens)
        with self._lock:
            self._sessions[s.id] = s
        return s

    def serve_unix(self, sid: str, path: str) -> Any:
        """A uvicorn server for episode `sid` alone on a new Unix socket at `path`, on the
        endpoint's event loop (`EpisodeSession.serve_unix`); -> the server (stop: `_stop`)."""
        import uvicorn

        if self._loop is None or self._app is None:
            raise RuntimeError("the agent endpoint is not started")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(path)
            sock.listen(64)  # connections queue from here on, before the server's first tick
        except BaseException:
            sock.close()
            raise
        config = uvicorn.Config(_EpisodePaths(self._app, f"/s/{sid}"), log_level="warning",
                                access_log=False, timeout_keep_alive=30, lifespan="off")  # fmt: skip
        server = uvicorn.Server(config)
        done = asyncio.run_coroutine_threadsafe(server.serve(sockets=[sock]), self._loop)
        done.add_done_callback(_log_failure)
        return server

    def _drop(self, sid: str) -> None:
        with self._lock:
            self._sessions.pop(sid, None)

    # ---- requests ------------------------------------------------------------------------------

    def _session(self, request: Request, sid: str) -> EpisodeSession:
        with self._lock:
            s = self._sessions.get(sid)
        if s is None:
            raise SessionError(404, "no such episode (it ended, or the URL is wrong)")
        if not authorized(request.headers.raw, s.api_key):
            raise SessionError(401, "missing or wrong API key for this episode")
        return s

    @staticmethod
    def _check(obj: CompletionRequest | ChatCompletionRequest) -> None:
        """ValueError (400, counted) for what the endpoint does not take; before the call is
        admitted, so a refused request spends none of the episode's budget."""
        if obj.n != 1:
            raise ValueError("n: an agent episode's calls take n = 1 (each call is one step of "
                             "its trajectory)")  # fmt: skip
        if obj.stream_options is not None and not obj.stream:
            raise ValueError("stream_options can only be set when stream is true")
        bad = [b for b in obj.unsupported() if b != "tools"]  # tools: the chat template's
        if bad:
            raise ValueError(f"{bad[0]} is not supported by the episode endpoint")

    def _params(self, obj: CompletionRequest | ChatCompletionRequest, room: int,
                asked: int | None, prompt_len: int) -> SamplingParams:  # fmt: skip
        cap = min(self.max_turn_tokens, room)
        if asked is not None:
            cap = min(cap, asked)
        if self.context_tokens:
            if prompt_len >= self.context_tokens:
                raise ValueError(f"the prompt has {prompt_len} tokens; the context is "
                                 f"{self.context_tokens}")  # fmt: skip
            cap = min(cap, self.context_tokens - prompt_len)
        stop = [obj.stop] if isinstance(obj.stop, str) else (obj.stop or [])
        top_n = 0
        if isinstance(obj, ChatCompletionRequest):
            top_n = (obj.top_logprobs or 0) if obj.logprobs else 0
        else:
            top_n = obj.logprobs or 0
        return SamplingParams(
            temperature=self.temperature, max_new_tokens=max(1, cap), n=1, stop=tuple(stop),
            stop_token_ids=tuple(obj.stop_token_ids or ()), ignore_eos=obj.ignore_eos,
            top_logprobs=top_n, return_routed_experts=self.record_routing,
        )  # fmt: skip

    async def _generate(self, s: EpisodeSession, ids: list[int], params: SamplingParams,
                        request: Request) -> tuple[Completion, float]:  # fmt: skip
        req = GenerateRequest(list(ids), params)
        s.begin(req.request_id)
        t0 = time.monotonic()
        try:
            fut = self.engine.submit(req)
            wrapped = asyncio.wrap_future(fut)
            while True:
                done, _ = await asyncio.wait({wrapped}, timeout=0.5)
                if done:
                    break
                if await request.is_disconnected():
                    self.engine.abort(req.request_id)
            (c,) = wrapped.result()
        except BaseException:
            s.forget(req.request_id)
            raise
        if c.finish_reason == "abort":
            s.forget(req.request_id)
            raise SessionError(410, "the call was aborted (the episode ended or the engine "
                                    "dropped it)")  # fmt: skip
        return c, time.monotonic() - t0

    def app(self) -> FastAPI:
        app = FastAPI(title="slipstream agent episode endpoint")

        async def refuse(request: Request, status: int, message: str, param: str | None = None):
            sid = request.path_params.get("sid")
            with self._lock:
                s = self._sessions.get(sid) if sid else None
            if s is not None and status in (400, 422):
                s.count_bad()
            return error_response(status, message, param)

        @app.exception_handler(RequestValidationError)
        async def _bad_body(request: Request, exc: RequestValidationError) -> JSONResponse:
            parts, param = [], None
            for e in exc.errors():
                loc = ".".join(str(p) for p in e["loc"] if p != "body")
                param = param or loc
                shown = reprlib.repr(e.get("input"))
                parts.append(f"{loc}: {e['msg']} (got {shown[:60]})")
            return await refuse(request, 400, "invalid request: " + "; ".join(parts[:5]), param)

        @app.exception_handler(SessionError)
        async def _session_error(request: Request, exc: SessionError) -> JSONResponse:
            return error_response(exc.status, str(exc))

        @app.exception_handler(ValueError)
        async def _bad_value(request: Request, exc: ValueError) -> JSONResponse:
            return await refuse(request, 400, str(exc))

        @app.exception_handler(RuntimeError)
        async def _engine_error(request: Request, exc: RuntimeError) -> JSONResponse:
            return error_response(500, f"engine error: {exc}")

        def model_card() -> dict[str, Any]:
            return {"id": self.model_name, "object": "model", "created": 0,
                    "owned_by": "slipstream"}  # fmt: skip

        @app.get("/s/{sid}/v1/models")
        async def models(sid: str, request: Request) -> dict[str, Any]:
            self._session(request, sid)
            return {"object": "list", "data": [model_card()]}

        @app.post("/s/{sid}/v1/chat/completions")
        async def chat(sid: str, obj: ChatCompletionRequest, request: Request) -> Any:
            s = self._session(request, sid)
            self._check(obj)
            messages = [m.template_fields() for m in obj.messages]  # as slipstream serve
            ids = self.tokenizer.chat_prompt(messages, obj.add_generation_prompt,
                                             tools=obj.tools or None)  # fmt: skip
            room = s.admit()
            params = self._params(obj, room, obj.max_new_tokens(self.max_turn_tokens), len(ids))
            c, latency = await self._generate(s, ids, params, request)
            reply: dict[str, Any] = {"role": "assistant", "content": c.text}
            finish = c.finish_reason
            if obj.tools and obj.tool_choice != "none":
                content, calls = parse_tool_calls(c.text)
                if calls:
                    reply = {"role": "assistant", "content": content or None, "tool_calls": calls}
                    finish = "tool_calls"
            s.record(CallRecord("chat", list(ids), c, messages, reply, latency))
            head = {"id": f"chatcmpl-{c.request_id}", "created": int(time.time()),
                    "model": self.model_name}  # fmt: skip
            if obj.stream:
                return StreamingResponse(self._chat_stream(obj, c, head, reply, finish),
                                         media_type="text/event-stream")  # fmt: skip
            logprobs = None
            if obj.logprobs:
                tops = c.top_logprobs if params.top_logprobs else None
                logprobs = {"content": chat_logprob_entries(c.token_ids, c.logprobs, tops,
                                                            self._token_str), "refusal": None}  # fmt: skip
            choice = {"index": 0, "message": reply, "logprobs": logprobs,
                      "finish_reason": finish, "token_ids": c.token_ids}  # fmt: skip
            return {**head, "object": "chat.completion", "choices": [choice],
                    "usage": _usage(len(ids), len(c.token_ids))}  # fmt: skip

        @app.post("/s/{sid}/v1/completions")
        async def completions(sid: str, obj: CompletionRequest, request: Request) -> Any:
            s = self._session(request, sid)
            p = obj.prompt
            if isinstance(p, str):
                ids = self.tokenizer.encode_prompt(p)
            elif p and all(isinstance(t, int) for t in p):
                ids = list(p)  # type: ignore[arg-type]
            else:
                raise ValueError("prompt: an agent episode's completion call takes one prompt "
                                 "(a string or a list of token ids)")  # fmt: skip
            if not ids:
                raise ValueError("prompt is empty")
            if obj.echo:
                raise ValueError("echo is not supported by the episode endpoint")
            self._check(obj)
            room = s.admit()
            params = self._params(obj, room, obj.max_tokens, len(ids))
            c, latency = await self._generate(s, ids, params, request)
            s.record(CallRecord("completion", list(ids), c, latency_s=latency))
            head = {"id": f"cmpl-{c.request_id}", "object": "text_completion",
                    "created": int(time.time()), "model": self.model_name}  # fmt: skip
            if obj.stream:
                return StreamingResponse(self._completion_stream(obj, c, head),
                                         media_type="text/event-stream")  # fmt: skip
            logprobs = None
            if obj.logprobs is not None:
                tops = c.top_logprobs if params.top_logprobs else None
                logprobs = completion_logprobs(c.token_ids, list(c.logprobs), tops,
                                               self._token_str)  # fmt: skip
            choice = {"index": 0, "text": c.text, "logprobs": logprobs,
                      "finish_reason": c.finish_reason, "token_ids": c.token_ids}  # fmt: skip
            return {**head, "choices": [choice], "usage": _usage(len(ids), len(c.token_ids))}

        return app

    def _token_str(self, t: int) -> str:
        return self.tokenizer.decode([t])

    async def _chat_stream(self, obj: ChatCompletionRequest, c: Completion, head: dict[str, Any],
                           reply: dict[str, Any], finish: str) -> AsyncIterator[bytes]:  # fmt: skip
        head = {**head, "object": "chat.completion.chunk"}
        ts = TextStream(self.tokenizer.decode, [s for s in (obj.stop or []) if s] if not
                        isinstance(obj.stop, str) else [obj.stop])  # fmt: skip
        yield sse({**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                        "logprobs": None, "finish_reason": None}]})  # fmt: skip
        calls = reply.get("tool_calls")
        if calls:  # the parsed message: its content, then its calls, as one delta each
            if reply["content"]:
                yield sse({**head, "choices": [{"index": 0, "delta": {"content": reply["content"]},
                                                "logprobs": None, "finish_reason": None}]})  # fmt: skip
            deltas = [{"index": k, **call} for k, call in enumerate(calls)]
            yield sse({**head, "choices": [{"index": 0, "delta": {"tool_calls": deltas},
                                            "logprobs": None, "finish_reason": None}]})  # fmt: skip
        for i, t in enumerate([] if calls else c.token_ids):
            delta = ts.push(t)
            lp = None
            if obj.logprobs:
                lp = {"content": chat_logprob_entries([t], [c.logprobs[i]], None,
                                                      self._token_str), "refusal": None}  # fmt: skip
            if delta or lp:
                yield sse({**head, "choices": [{"index": 0, "delta": {"content": delta},
                                                "logprobs": lp, "finish_reason": None}]})  # fmt: skip
        rest = "" if calls else ts.finish(c)
        yield sse({**head, "choices": [{"index": 0, "delta": {"content": rest} if rest else {},
                                        "logprobs": None, "finish_reason": finish}]})  # fmt: skip
        if obj.stream_options is not None and obj.stream_options.include_usage:
            yield sse({**head, "choices": [],
                       "usage": _usage(len(c.prompt_ids), len(c.token_ids))})  # fmt: skip
        yield sse("[DONE]")

    async def _completion_stream(self, obj: CompletionRequest, c: Completion,
                                 head: dict[str, Any]) -> AsyncIterator[bytes]:  # fmt: skip
        stops = [obj.stop] if isinstance(obj.stop, str) else (obj.stop or [])
        ts = TextStream(self.tokenizer.decode, stops)
        for t in c.token_ids:
            delta = ts.push(t)
            if delta:
                yield sse({**head, "choices": [{"index": 0, "text": delta, "logprobs": None,
                                                "finish_reason": None}]})  # fmt: skip
        yield sse({**head, "choices": [{"index": 0, "text": ts.finish(c), "logprobs": None,
                                        "finish_reason": c.finish_reason}]})  # fmt: skip
        if obj.stream_options is not None and obj.stream_options.include_usage:
            yield sse({**head, "choices": [],
                       "usage": _usage(len(c.prompt_ids), len(c.token_ids))})  # fmt: skip
        yield sse("[DONE]")


TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def parse_tool_calls(text: str) -> tuple[str, list[dict[str, Any]]]:
    """Tool calls in the Hermes format that Qwen's chat templates define (`<tool_call>{"name":
    ..., "arguments": {...}}</tool_call>`, one block per call) -> (the text before the first
    call, OpenAI `tool_calls`). A block that is not such JSON leaves the whole text as content
    and no calls (vLLM's hermes parser does the same)."""
    blocks = TOOL_CALL.findall(text)
    if not blocks:
        return text, []
    calls = []
    for b in blocks:
        try:
            obj = json.loads(b)
        except ValueError:
            return text, []
        if not (isinstance(obj, dict) and isinstance(obj.get("name"), str)):
            return text, []
        args = obj.get("arguments", {})
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": obj["name"],
                                   "arguments": args if isinstance(args, str) else json.dumps(args)}})  # fmt: skip
    return text[: text.index("<tool_call>")].strip(), calls


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}  # fmt: skip


__all__ = ["AgentEndpoint", "CallRecord", "EpisodeSession", "SessionError", "parse_tool_calls"]
