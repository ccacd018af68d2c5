"""The host agent's wire protocol, shared by the agent (host_agent.py) and its client
(agent_pool.py). Described for humans in docs/sandbox.md, "Host agent".

Transport: a Unix stream socket (`unix:///path`). Frames in both directions are a 4-byte
big-endian length plus a UTF-8 JSON object, as the guest agent's (agent_client.py); at most
`MAX_FRAME_BYTES`. Every request carries `type` and an integer `id` unique within its connection;
the reply echoes the `id` and is `{"type": "ok", ...}` or `{"type": "error", "code": CODE,
"error": TEXT}`. Requests on one connection are served concurrently (replies may come out of
order); operations on one lease are serialised by the sandbox's own channel.

The first request must be `hello` (protocol `version`, the client's `pid`/`name`, and the
`template` it expects, or null to take the agent's). The agent answers with its template, the
lease TTL and its capacity, or refuses (`version`, `template_mismatch`, `forbidden`) and closes.

A connection is a session: the leases it was granted belong to it alone (a lease id sent on
another connection is unknown there) and end when it closes. Any frame renews the session's
leases; a session that sends nothing for `lease_ttl_s` loses them (the agent destroys the
sandboxes). Binary payloads (stdin, files) are base64.

Not covered: authentication beyond the socket's file permissions and the peer's uid
(SO_PEERCRED), several templates per agent, TCP.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import math
import struct
from collections.abc import Mapping
from dataclasses import asdict, fields
from typing import Any

from slipstream.sandbox.agent_client import MAX_FRAME_BYTES
from slipstream.sandbox.agent_client import encode_frame as encode_frame  # re-exported
from slipstream.sandbox.base import ExecResult, SandboxTemplate
from slipstream.sandbox.errors import (
    AgentUnavailable,
    LeaseExpired,
    NoCapacity,
    SandboxBroken,
    SandboxError,
)

PROTOCOL_VERSION = 1
DEFAULT_SOCKET = "/run/slipstream/sandbox-agent.sock"
URL_SCHEME = "unix://"
# Fields a client's template must share with the agent's: what a sandbox *is*. The timeouts are
# per call (the client passes its own) and not compared.
TEMPLATE_FIELDS_COMPARED = ("backend", "image", "vcpus", "memory_mib", "pinning", "memory_policy",
                            "pids_max", "output_cap_bytes", "workdir_mib", "network")  # fmt: skip

# error code -> the exception the client raises (the text is the agent's message)
ERROR_CLASSES: dict[str, type[SandboxError]] = {
    "no_capacity": NoCapacity,
    "stopping": AgentUnavailable,
    "forbidden": AgentUnavailable,
    "version": AgentUnavailable,
    "template_mismatch": AgentUnavailable,
    "expired": LeaseExpired,
    "broken": SandboxBroken,
    "unknown_lease": SandboxError,
    "sandbox_error": SandboxError,
    "bad_request": SandboxError,
}


class ProtocolError(ValueError):
    """A peer sent something the protocol does not allow; the message says what."""


def parse_agent_url(url: str) -> str:
    """`unix:///abs/path` -> `/abs/path`; ValueError naming the URL otherwise."""
    if not isinstance(url, str) or not url.startswith(URL_SCHEME):
        raise ValueError(f"sandbox agent URL {url!r} must look like unix:///path/to/socket")
    path = url[len(URL_SCHEME) :]
    if not path.startswith("/") or path == "/" or "\0" in path:
        raise ValueError(f"sandbox agent URL {url!r}: the socket path must be absolute")
    return path


def agent_url(socket_path: str) -> str:
    return URL_SCHEME + socket_path


async def read_frame(reader: asyncio.StreamReader) -> dict[str, Any]:
    """One frame as a dict. asyncio.IncompleteReadError at EOF; ProtocolError for an oversized,
    non-JSON or non-object frame (the stream cannot be trusted afterwards: close it)."""
    (length,) = struct.unpack(">I", await reader.readexactly(4))
    if length > MAX_FRAME_BYTES:
        raise ProtocolError(f"frame of {length} bytes exceeds {MAX_FRAME_BYTES}")
    body = await reader.readexactly(length)
    try:
        msg = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ProtocolError(f"frame is not JSON: {e}") from None
    if not isinstance(msg, dict):
        raise ProtocolError(f"frame is a JSON {type(msg).__name__}, not an object")
    return msg


def b64e(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def b64d(text: object, what: str) -> bytes:
    if not isinstance(text, str):
        raise ProtocolError(f"{what} must be a base64 string")
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise ProtocolError(f"{what} is not valid base64") from None


def template_to_dict(t: SandboxTemplate) -> dict[str, Any]:
    return asdict(t)


def template_from_dict(d: Mapping[str, Any]) -> SandboxTemplate:
    """A template from its dict; ProtocolError naming the field when it does not fit."""
    if not isinstance(d, Mapping):
        raise ProtocolError("template must be an object")
    known = {f.name for f in fields(SandboxTemplate)}
    unknown = sorted(set(d) - known)
    if unknown:
        raise ProtocolError(f"template has unknown fields {unknown}")
    try:
        return SandboxTemplate(**d)
    except (TypeError, ValueError) as e:
        raise ProtocolError(f"template refused: {e}") from None


def template_mismatch(agent: SandboxTemplate, client: SandboxTemplate) -> list[str]:
    """`field: agent X, client Y` for every compared field that differs (empty when they fit)."""
    return [
        f"{name}: agent {getattr(agent, name)!r}, client {getattr(client, name)!r}"
        for name in TEMPLATE_FIELDS_COMPARED
        if getattr(agent, name) != getattr(client, name)
    ]


def exec_result_to_dict(r: ExecResult) -> dict[str, Any]:
    return r.to_dict()


def exec_result_from_dict(d: Mapping[str, Any]) -> ExecResult:
    known = {f.name for f in fields(ExecResult)}
    return ExecResult(**{k: v for k, v in d.items() if k in known})


def positive_seconds(value: object, what: str, *, allow_zero: bool = False) -> float:
    """A finite number of seconds (> 0, or >= 0 with allow_zero); ProtocolError otherwise."""
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < 0 or (value == 0 and not allow_zero):
        raise ProtocolError(f"{what} = {value!r}: must be a finite number of seconds")
    return float(value)


def error_from_reply(reply: Mapping[str, Any], what: str) -> SandboxError:
    """The exception a client raises for an error reply to `what`."""
    code = str(reply.get("code", "sandbox_error"))
    cls = ERROR_CLASSES.get(code, SandboxError)
    return cls(f"host agent: {what}: {reply.get('error', code)}")
