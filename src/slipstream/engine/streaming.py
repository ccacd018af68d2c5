"""Running requests for the HTTP server: engine futures and per-token events on the event loop,
cancellation when the client goes away, incremental text and server-sent events.

`Runner.run` submits requests and waits for them, aborting them in the engine when the client
disconnects first. `Runner.stream` does the same but yields every `StreamEvent` as it happens:
the engine thread's hook hands each event to the event loop (`call_soon_threadsafe`), the async
generator yields them, and closing the generator (the client went away, or the response ended)
aborts whatever is still running. Request ids in flight are unique (a second request reusing
one is refused), so `abort` never touches another client's work.

`TextStream` turns a sample's tokens into text deltas whose concatenation is exactly the
final `Completion.text`: it holds back a trailing U+FFFD (a UTF-8 sequence split across tokens)
and, for requests with stop strings, the last len(longest stop) - 1 characters, which a stop
string completed later would cut away.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from fastapi import Request

from slipstream.engine.base import Completion, GenerateRequest, StreamEvent
from slipstream.engine.native import NativeEngine

log = logging.getLogger(__name__)


class ClientGone(Exception):
    """The client disconnected before its requests finished (they were aborted)."""


class Runner:
    """Submits requests to one engine on behalf of HTTP handlers."""

    def __init__(self, engine: NativeEngine) -> None:
        self.engine = engine
        self.inflight: set[str] = set()

    def validate(self, requests: Sequence[GenerateRequest]) -> None:
        """ValueError (400) for a rid in flight or a request the engine would refuse: what
        `run` and `stream` check first. A streaming handler calls it before it answers 200 (a
        stream's own checks run only once the response has started)."""
        ids = [r.request_id for r in requests]
        dup = {i for i in ids if ids.count(i) > 1} | (set(ids) & self.inflight)
        if dup:
            raise ValueError(f"rid {sorted(dup)[0]!r} is already in use by a request in flight")
        for r in requests:  # ValueError -> 400 before any of them runs
            self.engine.validate(r)

    def _register(self, requests: Sequence[GenerateRequest]) -> None:
        self.validate(requests)
        self.inflight.update(r.request_id for r in requests)

    def _abort(self, requests: Sequence[GenerateRequest]) -> None:
        for r in requests:
            self.engine.abort(r.request_id)

    async def run(self, http: Request, requests: list[GenerateRequest]) -> list[list[Completion]]:
        """Each request's completions; ClientGone (after aborting them) if the client left."""
        self._register(requests)
        try:
            futures = []
            try:
                for r in requests:
                    futures.append(asyncio.wrap_future(self.engine.submit(r)))
            except (ValueError, RuntimeError):
                self._abort(requests)
                raise
            gathered = asyncio.ensure_future(asyncio.gather(*futures))
            gone = asyncio.ensure_future(_disconnected(http))
            done, _ = await asyncio.wait({gathered, gone}, return_when=asyncio.FIRST_COMPLETED)
            if gathered not in done:
                self._abort(requests)
                await asyncio.gather(gathered, return_exceptions=True)
                raise ClientGone()
            gone.cancel()
            return list(gathered.result())
        finally:
            self.inflight.difference_update(r.request_id for r in requests)

    async def stream(
        self, requests: list[GenerateRequest]
    ) -> AsyncIterator[tuple[int, StreamEvent]]:
        """(request index, event) for every token and every finished sample, in order per
        sample; ends when all samples finished. An engine failure is raised after the events
        that preceded it. Closing the generator aborts the requests still running."""
        self._register(requests)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()

        def hook(i: int) -> Callable[[StreamEvent], None]:
            return lambda event: loop.call_soon_threadsafe(queue.put_nowait, (i, event))

        streaming = [
            GenerateRequest(r.prompt_ids, r.params, r.request_id, stream=hook(i))
            for i, r in enumerate(requests)
        ]
        pending = len(requests)
        finished = False
        try:
            for i, r in enumerate(streaming):
                future = self.engine.submit(r)
                future.add_done_callback(
                    lambda f, i=i: loop.call_soon_threadsafe(queue.put_nowait, (i, f))
                )
            while pending:
                i, item = await queue.get()
                if isinstance(item, StreamEvent):
                    yield i, item
                    continue
                pending -= 1  # a request's future resolved (after all its events)
                if item.exception() is not None:
                    raise item.exception()
            finished = True
        finally:
            if not finished:
                self._abort(requests)
            self.inflight.difference_update(r.request_id for r in requests)


async def _disconnected(http: Request) -> None:
    """Returns when the client disconnects (the body has been read, so the next ASGI message
    is the disconnect)."""
    while True:
        message = await http.receive()
        if message["type"] == "http.disconnect":
            return


class TextStream:
    """Text deltas of one sample (see the module docstring). `push(token)` -> the new safe
    text; `finish(completion)` -> the rest of `completion.text`."""

    def __init__(self, decode: Callable[[list[int]], str] | None, stops: Sequence[str]) -> None:
        self.decode = decode
        self.holdback = max((len(s) for s in stops), default=1) - 1
        self.stops = tuple(stops)
        self.tokens: list[int] = []
        self.sent = ""

    def push(self, token: int) -> str:
        self.tokens.append(token)
        if self.decode is None:
            return ""
        text = self.decode(self.tokens)
        if any(s in text for s in self.stops):
            return ""  # the engine cuts the text at the stop; the final flush sends the rest
        safe = len(text) - self.holdback
        while safe > 0 and text[safe - 1] == "\ufffd":
            safe -= 1
        if safe <= len(self.sent) or not text.startswith(self.sent):
            return ""
        delta = text[len(self.sent) : safe]
        self.sent += delta
        return delta

    def finish(self, completion: Completion) -> str:
        final = completion.text
        if not final.startswith(self.sent):  # a decoder that rewrote earlier text
            log.warning("streamed text is not a prefix of the final text (request %s)",
                        completion.request_id)  # fmt: skip
            return ""
        delta = final[len(self.sent) :]
        self.sent = final
        return delta


def sse(data: Any) -> bytes:
    """One server-sent event carrying `data` as JSON (or the literal [DONE])."""
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {payload}\n\n".encode()
