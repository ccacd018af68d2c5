"""Sandbox file I/O against hostile commands: whatever a command leaves in the work dir (a FIFO, a
socket, a directory, a symlink out or to a FIFO, a huge sparse file) is refused by `get_file`,
`put_file` and `exec(files=...)` at once, never waited on, and the sandbox keeps working; the
host bounds every file operation by the exec timeout (an agent that never answers is declared
broken within it); the code verifier scores a candidate that turns its results file into any of
these 0 ("results unreadable") instead of stalling, then scores a correct candidate 1.0 in the
same sandbox.

A stall would show as SandboxBroken ("no reply ... within"), which every case asserts against:
no timing assertions. Backends: process (always) and bwrap (root + /usr/bin/bwrap). The qemu
backend runs the same agent; not run here (one TCG boot per test).
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import pytest

from slipstream.sandbox.agent_client import AgentConnection
from slipstream.sandbox.base import AgentSandbox, SandboxTemplate, make_backend
from slipstream.sandbox.errors import SandboxBroken, SandboxError
from slipstream.sandbox.journal import SandboxRecord
from slipstream.tasks.code import BY_NAME, verify_code

BWRAP_OK = os.geteuid() == 0 and os.access("/usr/bin/bwrap", os.X_OK)
BACKENDS = ["process", pytest.param("bwrap", marks=pytest.mark.skipif(
    not BWRAP_OK, reason="bwrap needs root and /usr/bin/bwrap"))]  # fmt: skip
IO_TIMEOUT_S = 20.0  # far above any real file operation; reaching it means the agent stalled

# How a command plants each thing at `x` (python3, run in the work dir).
PLANT = {
    "fifo": "import os; os.mkfifo('x')",
    "socket": "import socket; s = socket.socket(socket.AF_UNIX); s.bind('x')",
    "directory": "import os; os.mkdir('x')",
    "symlink out": "import os; os.symlink('/etc/passwd', 'x')",
    "symlink to a fifo": "import os; os.mkfifo('f'); os.symlink('f', 'x')",
    "symlink to a dir out": "import os; os.symlink('/usr', 'x')",
    "dir symlink out on the path": "import os; os.symlink('/etc', 'x')",
}
WHY = {
    "fifo": "is a FIFO, not a regular file",
    "socket": "is a socket, not a regular file",
    "directory": "is a directory, not a regular file",
    "symlink out": "leaves the work directory",
    "symlink to a fifo": "is a FIFO, not a regular file",
    "symlink to a dir out": "leaves the work directory",
    "dir symlink out on the path": "leaves the work directory",
}


@pytest.fixture(params=BACKENDS)
def sandbox(request, tmp_path: Path):
    """(run, sandbox) with a fresh sandbox of the backend; released afterwards."""
    backend = make_backend(request.param, state_dir=tmp_path / "state")
    loop = asyncio.new_event_loop()
    template = SandboxTemplate(backend=request.param, memory_mib=256, workdir_mib=64,
                               exec_timeout_s=30)  # fmt: skip
    sb = loop.run_until_complete(backend.create(template, sandbox_id=f"io-{os.getpid()}"))
    try:
        yield loop.run_until_complete, sb
    finally:
        loop.run_until_complete(sb.release())
        loop.close()


def plant(run, sb, kind: str) -> None:
    r = run(sb.exec(["python3", "-c", PLANT[kind]], timeout_s=30))
    assert r.exit_code == 0, r.stderr


def still_works(run, sb) -> None:
    run(sb.ping())
    run(sb.put_file("ok/data.bin", bytes(range(256)) * 64, mode=0o600))
    assert run(sb.get_file("ok/data.bin", timeout_s=IO_TIMEOUT_S)) == bytes(range(256)) * 64
    r = run(sb.exec(["sh", "-c", "cat ok/data.bin | wc -c"], files={"in.txt": b"hi"}))
    assert r.exit_code == 0 and r.stdout.strip() == "16384"


@pytest.mark.parametrize("kind", list(PLANT))
def test_get_and_put_refuse_what_a_command_planted(sandbox, kind: str) -> None:
    run, sb = sandbox
    plant(run, sb, kind)
    path = "x/inner" if kind == "dir symlink out on the path" else "x"
    for op in (sb.get_file(path, timeout_s=IO_TIMEOUT_S),
               sb.put_file(path, b"payload", timeout_s=IO_TIMEOUT_S)):  # fmt: skip
        with pytest.raises(SandboxError) as info:
            run(op)
        assert not isinstance(info.value, SandboxBroken), info.value  # refused, not stalled
        assert WHY[kind] in str(info.value), info.value
    with pytest.raises(SandboxError) as info:
        run(sb.exec(["true"], files={path: b"payload"}))
    assert not isinstance(info.value, SandboxBroken) and WHY[kind] in str(info.value)
    # nothing was written through it: the planted thing is unchanged
    check = {
        "fifo": "test -p x",
        "socket": "test -S x",
        "directory": "test -d x && ! test -e x/*",
        "symlink out": "test -L x",
        "symlink to a fifo": "test -p f && test -L x",
        "symlink to a dir out": "test -L x",
        "dir symlink out on the path": "test -L x",
    }
    assert run(sb.exec(["sh", "-c", check[kind]])).exit_code == 0
    still_works(run, sb)
    run(sb.reset())  # wipes FIFOs, sockets, links alike
    assert run(sb.exec(["sh", "-c", "ls -A | wc -l"])).stdout.strip() == "0"


def test_links_inside_the_work_dir_are_followed_and_sizes_capped(sandbox) -> None:
    run, sb = sandbox
    r = run(sb.exec(["sh", "-c", "echo hello > real && ln -s real link && "
                                 "truncate -s 512M sparse"]))  # fmt: skip
    assert r.exit_code == 0, r.stderr
    assert run(sb.get_file("link", timeout_s=IO_TIMEOUT_S)) == b"hello\n"
    with pytest.raises(SandboxError, match="more than max_bytes=1024") as info:
        run(sb.get_file("sparse", timeout_s=IO_TIMEOUT_S, max_bytes=1024))
    assert not isinstance(info.value, SandboxBroken)
    with pytest.raises(SandboxError, match="more than max_bytes"):  # the 16 MiB default
        run(sb.get_file("sparse", timeout_s=IO_TIMEOUT_S))
    still_works(run, sb)


# ---- the host bounds file operations by the exec timeout ---------------------------------

SILENT_AGENT = r"""
import json, os, struct, sys
body = json.dumps({"type": "hello", "version": "1", "pid": os.getpid()}).encode()
sys.stdout.buffer.write(struct.pack(">I", len(body)) + body); sys.stdout.buffer.flush()
while sys.stdin.buffer.read(1):    # reads every request, answers none (a stuck agent)
    pass
"""


class SilentSandbox(AgentSandbox):
    def __init__(self, proc, conn, template: SandboxTemplate) -> None:
        super().__init__("silent", template, conn)
        self.proc = proc

    def record(self) -> SandboxRecord:
        return SandboxRecord(sandbox_id=self.sandbox_id, backend="process", pid=self.proc.pid)

    async def _destroy(self) -> None:
        self.proc.kill()
        await self.proc.wait()


def test_file_operations_wait_no_longer_than_the_exec_timeout() -> None:
    async def go() -> None:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", SILENT_AGENT, stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE)  # fmt: skip
        conn = AgentConnection(proc.stdout, proc.stdin, name="silent")
        await conn.wait_hello(20)
        sb = SilentSandbox(proc, conn, SandboxTemplate(backend="process", exec_timeout_s=0.25))
        with pytest.raises(SandboxBroken, match="no reply to get_file within 5.25 s"):
            await sb.get_file("results.jsonl")  # default: exec timeout + the agent grace
        await sb.release()

        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", SILENT_AGENT, stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE)  # fmt: skip
        conn = AgentConnection(proc.stdout, proc.stdin, name="silent")
        await conn.wait_hello(20)
        sb = SilentSandbox(proc, conn, SandboxTemplate(backend="process"))
        with pytest.raises(SandboxBroken, match="no reply to put_file within 0.2 s"):
            await sb.put_file("a", b"x", timeout_s=0.2)
        with pytest.raises(SandboxBroken, match="broken"):  # and it stays broken: destroy it
            await sb.get_file("a", timeout_s=0.2)
        await sb.release()
        with pytest.raises(SandboxError, match="after release"):
            await sb.get_file("a")

    asyncio.run(go())


# ---- the code verifier ------------------------------------------------------------------

REPLACE_RESULTS = {
    "fifo": "os.mkfifo('results.jsonl')",
    "fifo with a writer left behind": (
        "os.mkfifo('results.jsonl')\n"
        "if os.fork() == 0:\n    os.setsid(); open('results.jsonl', 'w'); time.sleep(600)"),
    "directory": "os.mkdir('results.jsonl')",
    "symlink out": "os.symlink('/etc/passwd', 'results.jsonl')",
    "socket": "s = socket.socket(socket.AF_UNIX); s.bind('results.jsonl')",
    "removed": "pass",
    "huge sparse file": "open('results.jsonl', 'w').truncate(64 << 20)",
}  # fmt: skip


@pytest.mark.parametrize("case", list(REPLACE_RESULTS))
def test_candidate_that_replaces_its_results_file_scores_zero_at_once(sandbox, case) -> None:
    run, sb = sandbox
    candidate = ("import os, socket, time\n"
                 "os.remove('results.jsonl')\n"
                 f"{REPLACE_RESULTS[case]}\n"
                 "def add(a, b):\n    return a + b\n")  # fmt: skip
    v = run(verify_code(BY_NAME["add"], candidate, sb, timeout_s=5.0))
    assert v.reward == 0.0 and v.reason.startswith("results unreadable"), v
    assert "within" not in v.reason, v  # refused, not timed out
    good = run(verify_code(BY_NAME["add"], BY_NAME["add"].reference, sb, timeout_s=5.0))
    assert good.reward == 1.0, good
    still_works(run, sb)
