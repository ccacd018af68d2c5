"""Host side of the guest-agent protocol (see `slipstream/sandbox/guest/agent.py` for the wire format).

`AgentConnection` speaks length-prefixed JSON frames over any asyncio stream pair: the stdio pipes
of a bwrap/process sandbox, a QEMU virtio-serial Unix socket, a Firecracker vsock Unix socket after
`CONNECT <port>`. Requests are serialised (one in flight per connection), matching the agent.

`spawn_agent_process(argv, ...)` starts a process whose stdin/stdout is the agent channel and waits
for its `hello`.

Not covered: reconnecting after the channel breaks (the sandbox is then broken and must be
destroyed), concurrent requests on one connection.
"""

from __future__ import annotations

import asyncio
import base64
import json
import struct
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from slipstream.sandbox.errors import SandboxBroken, SandboxError

MAX_FRAME_BYTES = 64 * 1024 * 1024
AGENT_PATH_IN_PACKAGE = "guest/agent.py"
# The agent enforces the command's timeout; the host waits this much longer before it declares the
# agent itself hung.
AGENT_GRACE_S = 5.0


@dataclass
class AgentExit:
    """What the agent reported for one exec (raw bytes; the sandbox adds cgroup facts)."""

    exit_code: int | None
    signal: int | None
    stdout: bytes
    stderr: bytes
    timed_out: bool
    truncated: bool
    stdout_truncated: bool
    stderr_truncated: bool
    wall_s: float
    cpu_s: float
    max_rss_bytes: int
    host_wall_s: float


def encode_frame(msg: Mapping[str, Any]) -> bytes:
    body = json.dumps(msg, separators=(",", ":")).encode()
    return struct.pack(">I", len(body)) + body


class AgentConnection:
    """One agent channel. `name` appears in every error message."""

    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, name: str = "agent"
    ) -> None:
        self.reader = reader
        self.writer = writer
        self.name = name
        self.hello: dict[str, Any] | None = None
        self._next_id = 1
        self._lock = asyncio.Lock()
        self.broken: str | None = None

    @property
    def closed(self) -> bool:
        return self.broken is not None

    async def _read(self) -> dict[str, Any]:
        try:
            header = await self.reader.readexactly(4)
            (length,) = struct.unpack(">I", header)
            if length > MAX_FRAME_BYTES:
                raise SandboxBroken(
                    f"{self.name}: frame of {length} bytes exceeds {MAX_FRAME_BYTES}"
                )
            body = await self.reader.readexactly(length)
        except (asyncio.IncompleteReadError, OSError) as e:  # EOF, reset, EIO of a tty/serial
            self.broken = f"channel closed ({type(e).__name__})"
            raise SandboxBroken(f"{self.name}: agent channel closed: the agent died") from None
        msg = json.loads(body)
        if not isinstance(msg, dict):
            raise SandboxBroken(f"{self.name}: agent sent a non-object frame")
        return msg

    async def _write(self, msg: Mapping[str, Any]) -> None:
        try:
            self.writer.write(encode_frame(msg))
            await self.writer.drain()
        except OSError as e:
            self.broken = f"write failed ({type(e).__name__})"
            raise SandboxBroken(f"{self.name}: cannot write to the agent: {e}") from None

    async def wait_hello(self, timeout_s: float) -> dict[str, Any]:
        """Wait for the agent's `hello` frame (sent once when it is ready)."""
        try:
            msg = await asyncio.wait_for(self._read(), timeout_s)
        except TimeoutError:
            raise SandboxBroken(
                f"{self.name}: no hello from the agent within {timeout_s} s"
            ) from None
        if msg.get("type") != "hello":
            raise SandboxBroken(f"{self.name}: expected hello, got {msg!r:.200}")
        self.hello = msg
        return msg

    async def _request(self, msg: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        if self.broken:
            raise SandboxBroken(f"{self.name}: agent channel is broken: {self.broken}")
        async with self._lock:
            rid = self._next_id
            self._next_id += 1
            await self._write({**msg, "id": rid})
            try:
                reply = await asyncio.wait_for(self._read_reply(rid), timeout_s)
            except TimeoutError:
                self.broken = "request timed out"
                raise SandboxBroken(
                    f"{self.name}: no reply to {msg['type']} within {timeout_s} s"
                ) from None
        if reply.get("type") == "error":
            raise SandboxError(f"{self.name}: {msg['type']} failed: {reply.get('error')}")
        return reply

    async def _read_reply(self, rid: int) -> dict[str, Any]:
        while True:
            reply = await self._read()
            if reply.get("id") == rid:
                return reply

    async def ping(self, timeout_s: float = 2.0) -> None:
        reply = await self._request({"type": "ping"}, timeout_s)
        if reply.get("type") != "pong":
            raise SandboxBroken(f"{self.name}: ping answered with {reply!r:.200}")

    async def put_file(
        self, path: str, data: bytes, mode: int | None = None, timeout_s: float = 30.0
    ) -> None:
        msg: dict[str, Any] = {"type": "put_file", "path": path, "data": _b64(data)}
        if mode is not None:
            msg["mode"] = mode
        await self._request(msg, timeout_s)

    async def get_file(
        self, path: str, max_bytes: int = 16 << 20, timeout_s: float = 30.0
    ) -> bytes:
        reply = await self._request(
            {"type": "get_file", "path": path, "max_bytes": max_bytes}, timeout_s
        )
        return base64.b64decode(reply["data"])

    async def reset(self, timeout_s: float = 30.0) -> None:
        await self._request({"type": "reset"}, timeout_s)

    async def exec(
        self,
        argv: Sequence[str],
        *,
        stdin: bytes = b"",
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        timeout_s: float = 30.0,
        output_cap_bytes: int = 1 << 20,
        files: Mapping[str, bytes] | None = None,
        on_output: Callable[[str, bytes], None] | None = None,
    ) -> AgentExit:
        """Run argv in the sandbox; collect output (each stream capped by the agent)."""
        if self.broken:
            raise SandboxBroken(f"{self.name}: agent channel is broken: {self.broken}")
        msg: dict[str, Any] = {
            "type": "exec",
            "argv": list(argv),
            "timeout_s": timeout_s,
            "output_cap_bytes": output_cap_bytes,
        }
        if stdin:
            msg["stdin_b64"] = _b64(stdin)
        if env:
            msg["env"] = dict(env)
        if cwd:
            msg["cwd"] = cwd
        if files:
            msg["files"] = {k: _b64(v) for k, v in files.items()}
        out: dict[str, list[bytes]] = {"stdout": [], "stderr": []}
        t0 = time.perf_counter()
        async with self._lock:
            rid = self._next_id
            self._next_id += 1
            await self._write({**msg, "id": rid})
            deadline = time.monotonic() + timeout_s + AGENT_GRACE_S
            while True:
                remaining = deadline - time.monotonic()
                try:
                    frame = await asyncio.wait_for(self._read_reply(rid), max(remaining, 0.001))
                except TimeoutError:
                    self.broken = "exec outlived its timeout"
                    raise SandboxBroken(
                        f"{self.name}: agent did not finish exec within {timeout_s} s + "
                        f"{AGENT_GRACE_S} s grace"
                    ) from None
                kind = frame.get("type")
                if kind == "output":
                    data = base64.b64decode(frame["data"])
                    out[frame["stream"]].append(data)
                    if on_output is not None:
                        on_output(frame["stream"], data)
                elif kind == "exit":
                    break
                elif kind == "error":
                    raise SandboxError(
                        f"{self.name}: exec {argv[0]!r} failed: {frame.get('error')}"
                    )
                else:
                    raise SandboxBroken(
                        f"{self.name}: unexpected frame during exec: {frame!r:.200}"
                    )
        return AgentExit(
            exit_code=frame["exit_code"],
            signal=frame.get("signal"),
            stdout=b"".join(out["stdout"]),
            stderr=b"".join(out["stderr"]),
            timed_out=bool(frame["timed_out"]),
            truncated=bool(frame["truncated"]),
            stdout_truncated=bool(frame.get("stdout_truncated")),
            stderr_truncated=bool(frame.get("stderr_truncated")),
            wall_s=float(frame["wall_s"]),
            cpu_s=float(frame["cpu_s"]),
            max_rss_bytes=int(frame.get("max_rss_bytes") or 0),
            host_wall_s=time.perf_counter() - t0,
        )

    async def close(self) -> None:
        """Close our end; the agent sees EOF, kills its strays and exits."""
        if self.broken is None:
            self.broken = "closed"
        self.writer.close()
        try:
            await self.writer.wait_closed()
        except (ConnectionError, BrokenPipeError):
            pass


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def agent_source_path() -> str:
    """Path of the guest agent program inside the installed package."""
    from importlib import resources

    return str(resources.files("slipstream.sandbox").joinpath(AGENT_PATH_IN_PACKAGE))


async def spawn_agent_process(
    argv: Sequence[str],
    *,
    name: str,
    hello_timeout_s: float = 30.0,
    **popen_kwargs: Any,
) -> tuple[asyncio.subprocess.Process, AgentConnection]:
    """Start `argv` (which must end up running the agent on its stdin/stdout) and wait for hello.
    On failure the process is killed and SandboxBroken names the command and its stderr."""
    proc = await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        **popen_kwargs,
    )
    assert proc.stdout is not None and proc.stdin is not None
    conn = AgentConnection(proc.stdout, proc.stdin, name=name)
    try:
        await conn.wait_hello(hello_timeout_s)
    except SandboxBroken as e:
        if proc.returncode is None:
            proc.kill()
        await proc.wait()
        raise SandboxBroken(
            f"{e} (command {' '.join(argv)!r:.300}, exit {proc.returncode})"
        ) from None
    return proc, conn
