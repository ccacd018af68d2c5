"""What the HTTP server checks before any request reaches the engine: options, authentication,
request-size limits, weight sources and versions, and the one error shape every endpoint uses.

- Authentication (optional, as SGLang's and vLLM's `--api-key`): with `api_key` set, the admin
  endpoints (weight updates and version labels, abort, cache flush) need `Authorization: Bearer <key>`; with
  `api_key_scope = "all"` every endpoint but the health checks does. Keys are compared in
  constant time. Without a key nothing is authenticated (`serve` warns when it binds beyond
  loopback).
- Size: a body over `max_request_bytes` is refused with 413 before it is parsed (by its
  Content-Length, or while it is read when there is none); a request asking for more than
  `max_batch_samples` samples (prompts x n) gets 413 too.
- Weight sources: a local directory, or a URL whose scheme is in `weight_url_schemes` (default
  file:// and s3://, the weight store's); anything else (http://, ...) is 400.
- Versions: an integer in [0, MAX_VERSION], not below the served one unless
  `allow_version_rollback`.
- Errors: `{"error": {"message", "type", "param", "code"}}` (OpenAI's shape; `code` is the HTTP
  status as vLLM sends it), for every endpoint and status.

Not covered: TLS (put a proxy in front), rate limiting, per-client quotas.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import HTTPException, Request, Response
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from slipstream.engine.base import MAX_SAMPLES, MAX_VERSION

ADMIN_PATHS = frozenset(
    {"/update_weights_from_disk", "/abort_request", "/flush_cache", "/update_weights",
     "/update_weight_version", "/init_weights_update_group", "/update_weights_from_distributed",
     "/destroy_weights_update_group", "/update_weights_from_tensor",
     # vLLM's weight-transfer API (engine/weight_routes.py)
     "/init_weight_transfer_engine", "/start_weight_update", "/finish_weight_update",
     # the weights are the asset: reading them is an admin's too (issue 44)
     "/get_weights_by_name"}
)  # fmt: skip
PUBLIC_PATHS = frozenset({"/health", "/health_generate"})
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "conflict_error",
    413: "invalid_request_error",
    499: "client_closed_request",
    503: "service_unavailable",
}


@dataclass(frozen=True)
class ServeOptions:
    """Server-side settings of `create_app` (the `slipstream serve` flags)."""

    served_model_name: str = "slipstream"
    """The model id of /v1/models and of responses; requests naming another model get 404."""
    api_key: str | None = None
    """Bearer key required for the admin endpoints (all endpoints with api_key_scope "all")."""
    api_key_scope: str = "admin"
    max_request_bytes: int = 8 * 2**20
    max_batch_samples: int = 1024
    """Most samples (prompts x n) one request may ask for."""
    weight_url_schemes: tuple[str, ...] = ("file", "s3")
    allow_version_rollback: bool = False
    """Accept a weight_version below the served one (a job resumed from an older checkpoint
    against a long-lived server)."""
    enable_prompt_tokens_details: bool = False
    """OpenAI usage objects carry `prompt_tokens_details.cached_tokens` (vLLM's
    `--enable-prompt-tokens-details`; omitted otherwise, as vLLM)."""
    weight_sync_timeout_s: float = 120.0
    """Bound on every collective of a weight-update group this server joins (a sender that
    died mid-transfer frees the receiving thread after it); `engine.weight_sync_timeout_s`."""
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.api_key_scope not in ("admin", "all"):
            raise ValueError(f"api_key_scope must be 'admin' or 'all', got {self.api_key_scope!r}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must be non-empty (or None for no authentication)")


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    """{"error": {...}}: OpenAI's error object."""
    kind = _ERROR_TYPES.get(status, "server_error" if status >= 500 else "error")
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def error_response(
    status: int, message: str, param: str | None = None, extra: dict[str, Any] | None = None
) -> JSONResponse:
    """The OpenAI error object (plus `extra` top-level fields), for every endpoint."""
    body = {**(extra or {}), **error_body(status, message, param)}
    return JSONResponse(body, status_code=status)


def needs_key(path: str, options: ServeOptions) -> bool:
    if options.api_key is None:
        return False
    if path in ADMIN_PATHS:
        return True
    return options.api_key_scope == "all" and path not in PUBLIC_PATHS


def authorized(headers: list[tuple[bytes, bytes]], key: str) -> bool:
    """`Authorization: Bearer <key>` present and equal to `key` (constant-time compare)."""
    for name, value in headers:
        if name.lower() == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            if scheme.lower() == "bearer":
                return secrets.compare_digest(token.strip().encode(), key.encode())
    return False


class GuardMiddleware:
    """ASGI middleware: authentication and the body-size limit, before routing and parsing."""

    def __init__(self, app: ASGIApp, options: ServeOptions) -> None:
        self.app = app
        self.options = options

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        opts = self.options
        headers = scope.get("headers", [])
        if needs_key(scope["path"], opts) and not authorized(headers, opts.api_key or ""):
            await error_response(401, "missing or wrong API key (Authorization: Bearer <key>)")(
                scope, receive, send
            )
            return
        limit = opts.max_request_bytes
        length = next((v for k, v in headers if k.lower() == b"content-length"), None)
        if length is not None and (not length.isdigit() or int(length) > limit):
            await error_response(
                413, f"request body of {length.decode()[:20]} bytes exceeds the limit of {limit}"
            )(scope, receive, send)
            return
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:  # FastAPI turns this into the 413 response
                    raise HTTPException(413, f"request body exceeds the limit of {limit} bytes")
            return message

        await self.app(scope, limited_receive, send)


MAX_JSON_CONTAINERS = 8 * MAX_SAMPLES
"""Most JSON arrays + objects one body may hold: a request of the largest batch any server takes
(MAX_SAMPLES prompts, each a token list with its own sampling params and stop lists) fits."""
_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')


def parse_json_body(body: bytes) -> Any:
    """`json.loads`, after a count of the body's arrays and objects (outside strings) against
    MAX_JSON_CONTAINERS: 2M one-item lists in 8 MB took 1-4 s of parsing (most of it cyclic GC
    passes over the new lists) with the event loop blocked, before any model saw the request.
    The count costs ~2 ms (bytes.count) and, only when brackets are many, a string-stripping
    regex (~0.2 s for 8 MB of strings). Nesting deeper than Python's recursion limit is a 400."""
    if body.count(b"[") + body.count(b"{") > MAX_JSON_CONTAINERS:
        stripped = _JSON_STRING.sub(b"", body)
        containers = stripped.count(b"[") + stripped.count(b"{")
        if containers > MAX_JSON_CONTAINERS:
            raise HTTPException(413, f"request body holds {containers} JSON arrays and objects; "
                                     f"the limit is {MAX_JSON_CONTAINERS}")  # fmt: skip
    try:
        return json.loads(body)
    except RecursionError:
        raise HTTPException(400, "request body is nested too deeply") from None


class GuardedRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = parse_json_body(await self.body())
        return self._json


class GuardedRoute(APIRoute):
    """FastAPI's documented custom-route hook: every route parses its JSON body through
    `parse_json_body` (set as `app.router.route_class` before the routes are added)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def guarded(request: Request) -> Response:
            return await handler(GuardedRequest(request.scope, request.receive))

        return guarded


_VERSION_RE = re.compile(r"[0-9]{1,10}")


def parse_version(raw: str | None, current: int, options: ServeOptions) -> int:
    """The weight version of an update: absent -> current + 1; else a decimal integer in
    [0, MAX_VERSION], not below `current` unless rollback is allowed. ValueError names it."""
    if raw is None:
        version = current + 1
    else:
        text = str(raw).strip()
        if not _VERSION_RE.fullmatch(text):
            raise ValueError(
                f"weight_version {str(raw)[:40]!r} is not a non-negative decimal integer"
            )
        version = int(text)
    if version > MAX_VERSION:
        raise ValueError(f"weight_version {version} exceeds the maximum {MAX_VERSION}")
    if version < current and not options.allow_version_rollback:
        raise ValueError(
            f"weight_version {version} is below the served version {current} (versions only "
            "move forward; start the server with --allow-version-rollback to permit this)"
        )
    return version


def check_weight_source(path: str, options: ServeOptions) -> None:
    """ValueError unless `path` is a local directory or a URL with an allowed scheme."""
    if "://" in path:
        scheme = path.split("://", 1)[0].lower()
        if scheme not in options.weight_url_schemes:
            allowed = ", ".join(f"{s}://" for s in options.weight_url_schemes)
            raise ValueError(
                f"model_path scheme {scheme!r}:// is not allowed (allowed: local paths, "
                f"{allowed}; see --allow-weight-url-scheme)"
            )
        return
    if not Path(path).is_dir():
        raise ValueError(f"model_path {path} is not a directory")
