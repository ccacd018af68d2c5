"""The requests the host agent proxies to a leased sandbox: exec, put_file, get_file, reset,
ping. Each field a client sends is checked here (types, base64, finite timeouts) before the
sandbox sees it; paths are checked again by the guest agent (they may not leave the work dir).

Not covered: streaming output (the whole, capped result is one reply).
"""

from __future__ import annotations

from typing import Any

from slipstream.sandbox.base import AgentSandbox
from slipstream.sandbox.host_protocol import (
    ProtocolError,
    b64d,
    b64e,
    exec_result_to_dict,
    positive_seconds,
)


async def sandbox_op(kind: str, sb: AgentSandbox, msg: dict[str, Any]) -> dict[str, Any]:
    """Run one proxied request on `sb` and return the reply body. ProtocolError names a bad field;
    the sandbox's own errors (SandboxError, SandboxBroken) pass through."""
    timeout = msg.get("timeout_s")
    timeout_s = None if timeout is None else positive_seconds(timeout, "timeout_s")
    if kind == "exec":
        argv = msg["argv"]
        if not (isinstance(argv, list) and argv and all(isinstance(a, str) for a in argv)):
            raise ProtocolError("exec: argv must be a non-empty list of strings")
        env = msg.get("env")
        if env is not None and not (isinstance(env, dict) and all(
                isinstance(k, str) and isinstance(v, str) for k, v in env.items())):  # fmt: skip
            raise ProtocolError("exec: env must map strings to strings")
        files = msg.get("files")
        if files is not None and not isinstance(files, dict):
            raise ProtocolError("exec: files must map paths to base64 data")
        cwd = msg.get("cwd")
        if cwd is not None and not isinstance(cwd, str):
            raise ProtocolError("exec: cwd must be a string")
        result = await sb.exec(
            argv,
            stdin=b64d(msg["stdin_b64"], "stdin_b64") if msg.get("stdin_b64") else None,
            files={str(k): b64d(v, f"files[{k!r}]") for k, v in files.items()} if files else None,
            env=env, timeout_s=timeout_s, cwd=cwd,
        )  # fmt: skip
        return {"result": exec_result_to_dict(result)}
    if kind == "put_file":
        mode = msg.get("mode")
        if mode is not None and type(mode) is not int:
            raise ProtocolError("put_file: mode must be an integer")
        await sb.put_file(_path(msg), b64d(msg["data_b64"], "data_b64"), mode, timeout_s=timeout_s)
        return {}
    if kind == "get_file":
        max_bytes = msg.get("max_bytes")
        if max_bytes is not None and (type(max_bytes) is not int or max_bytes < 0):
            raise ProtocolError("get_file: max_bytes must be a non-negative integer")
        data = await sb.get_file(_path(msg), timeout_s=timeout_s, max_bytes=max_bytes)
        return {"data_b64": b64e(data)}
    if kind == "reset":
        await sb.reset()
        return {}
    await sb.ping()
    return {}


def _path(msg: dict[str, Any]) -> str:
    path = msg["path"]
    if not isinstance(path, str):
        raise ProtocolError("path must be a string")
    return path
