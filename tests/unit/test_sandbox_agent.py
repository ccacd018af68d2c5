"""The guest agent and its host client, run as a plain host process (no isolation needed here)."""

from __future__ import annotations

import asyncio
import os
import struct
import sys

import pytest

from slipstream.sandbox.agent_client import (
    AgentConnection,
    agent_source_path,
    encode_frame,
    spawn_agent_process,
)
from slipstream.sandbox.errors import SandboxBroken, SandboxError


async def _agent(tmp_path):
    return await spawn_agent_process(
        [sys.executable, "-I", "-S", agent_source_path(), "--workdir", str(tmp_path / "w")],
        name="test-agent",
        hello_timeout_s=20,
    )


def run(coro):
    return asyncio.run(coro)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_hello_exec_stdin_env_files(tmp_path):
    async def go():
        proc, conn = await _agent(tmp_path)
        assert conn.hello["version"] == "1" and conn.hello["pid"] == proc.pid
        r = await conn.exec(
            ["sh", "-c", 'cat; echo "$FOO" >&2; cat data/in.txt'],
            stdin=b"from-stdin\n",
            env={"FOO": "bar"},
            files={"data/in.txt": b"from-file"},
        )
        assert (r.exit_code, r.stdout, r.stderr) == (0, b"from-stdin\nfrom-file", b"bar\n")
        assert not r.timed_out and not r.truncated and r.wall_s > 0
        r = await conn.exec(["sh", "-c", "exit 3"])
        assert r.exit_code == 3
        r = await conn.exec(["definitely-not-a-command"])
        assert r.exit_code == 127 and b"cannot exec" in r.stderr
        await conn.close()
        assert await proc.wait() == 0

    run(go())


def test_large_stdin_and_binary_output(tmp_path):
    async def go():
        proc, conn = await _agent(tmp_path)
        blob = os.urandom(3 << 20)
        r = await conn.exec(["cat"], stdin=blob, output_cap_bytes=4 << 20)
        assert r.stdout == blob and not r.truncated
        await conn.close()
        await proc.wait()

    run(go())


def test_timeout_kills_group_and_strays(tmp_path):
    async def go():
        proc, conn = await _agent(tmp_path)
        r = await conn.exec(["sh", "-c", "sleep 60 & echo $! > bg.pid; sleep 60"], timeout_s=0.5)
        # killed by the timeout, not waited out: the host raises SandboxBroken past 0.5 + 5 s
        assert r.timed_out and r.exit_code == -9 and r.signal == 9 and r.wall_s < 60
        bg = int(await conn.get_file("bg.pid"))
        assert not _alive(bg)
        # a daemon that left the process group (setsid) is still killed after the command ends
        r = await conn.exec(["sh", "-c", "setsid sleep 60 & echo $! > d.pid"], timeout_s=5)
        assert r.exit_code == 0 and not r.timed_out
        daemon = int(await conn.get_file("d.pid"))
        assert not _alive(daemon)
        await conn.close()
        await proc.wait()

    run(go())


def test_output_cap_truncates_and_drains(tmp_path):
    async def go():
        proc, conn = await _agent(tmp_path)
        r = await conn.exec(
            [
                "python3",
                "-c",
                "import sys; sys.stdout.write('x'*5_000_000); print('e', file=sys.stderr)",
            ],
            output_cap_bytes=1000,
        )
        assert r.exit_code == 0 and r.stdout == b"x" * 1000
        assert r.truncated and r.stdout_truncated and not r.stderr_truncated
        assert r.stderr == b"e\n"
        await conn.close()
        await proc.wait()

    run(go())


def test_files_reset_and_path_escape(tmp_path):
    async def go():
        proc, conn = await _agent(tmp_path)
        await conn.put_file("a/b.txt", b"hello", mode=0o600)
        assert await conn.get_file("a/b.txt") == b"hello"
        with pytest.raises(SandboxError, match="leaves the work directory"):
            await conn.put_file("../escape.txt", b"x")
        assert not (tmp_path / "escape.txt").exists()
        with pytest.raises(SandboxError, match="leaves the work directory"):
            await conn.get_file("/etc/hostname")
        await conn.reset()
        assert os.listdir(tmp_path / "w") == []
        await conn.ping()
        await conn.close()
        await proc.wait()

    run(go())


def test_agent_death_is_sandbox_broken(tmp_path):
    async def go():
        proc, conn = await _agent(tmp_path)
        with pytest.raises(SandboxBroken, match="agent"):
            await conn.exec(["sh", "-c", f"kill -9 {proc.pid}"])
        with pytest.raises(SandboxBroken):
            await conn.ping()
        await proc.wait()

    run(go())


def test_bad_frames_answered_with_errors(tmp_path):
    async def go():
        proc, conn = await _agent(tmp_path)
        conn.writer.write(encode_frame({"type": "nope", "id": 7}))
        reply = await conn._read()
        assert reply["type"] == "error" and reply["id"] == 7 and "unknown request" in reply["error"]
        conn.writer.write(encode_frame({"type": "exec", "id": 8, "argv": []}))
        reply = await conn._read()
        assert reply["type"] == "error" and "empty argv" in reply["error"]
        # an oversized length header makes the agent give up on the channel
        conn.writer.write(struct.pack(">I", 1 << 31))
        await conn.writer.drain()
        assert await asyncio.wait_for(proc.wait(), 10) != 0
        await conn.close()

    run(go())


def test_connection_over_a_tty_device(tmp_path):
    """`--device PATH` on a terminal (as /dev/hvc0 in a VM): the agent puts it in raw mode, and the
    client works over any asyncio stream pair (here the pty master)."""
    import pty

    async def go():
        master, slave = pty.openpty()
        slave_path = os.ttyname(slave)
        child = await asyncio.create_subprocess_exec(
            sys.executable, "-I", "-S", agent_source_path(),
            "--device", slave_path, "--workdir", str(tmp_path / "w"),
        )  # fmt: skip
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader()
        await loop.connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(master, "rb", buffering=0)
        )
        wtransport, wprotocol = await loop.connect_write_pipe(
            lambda: asyncio.streams.FlowControlMixin(), os.fdopen(os.dup(master), "wb", buffering=0)
        )
        writer = asyncio.StreamWriter(wtransport, wprotocol, reader, loop)
        conn = AgentConnection(reader, writer, name="tty")
        hello = await conn.wait_hello(20)
        os.close(slave)  # kept open until the agent had it open: a master without slave reads EIO
        assert hello["pid"] == child.pid
        payload = bytes(range(256)) * 64  # every byte value survives the raw tty
        r = await conn.exec(["cat"], stdin=payload)
        assert r.stdout == payload
        child.kill()
        await child.wait()
        wtransport.close()

    run(go())
