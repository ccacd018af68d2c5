"""`process` backend: the guest agent as a plain host subprocess with rlimits. NOT isolation.

For development on machines without bubblewrap: commands see the host filesystem, network and
processes. It logs a loud warning once per process. Limits: RLIMIT_AS = memory_mib (a memory bomb
gets MemoryError/ENOMEM, not an OOM kill), RLIMIT_CORE = 0, CPU affinity from the pool's pinning.

`SubprocessSandbox` (also used by bwrap) is an agent sandbox whose agent is a host child process:
destroying it closes the channel (the agent kills its strays and exits), kills the process if it
lingers, removes its cgroup and dirs.

Not covered: pids limits (RLIMIT_NPROC is per-user and ignored for root), strays that escape the
agent's process tree after the agent itself was SIGKILLed (no cgroup to find them).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import ctypes
import functools
import logging
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from slipstream.rundir import private_dir, process_start_ticks
from slipstream.sandbox.agent_client import AgentConnection, agent_source_path
from slipstream.sandbox.base import AgentSandbox, Backend, SandboxTemplate
from slipstream.sandbox.cgroups import Cgroup
from slipstream.sandbox.errors import SandboxBroken
from slipstream.sandbox.journal import Journal, SandboxRecord

log = logging.getLogger(__name__)
PR_SET_PDEATHSIG = 1
_warned = False
STDERR_TAIL_BYTES = 4096


def set_pdeathsig() -> None:
    """In a forked child: die with SIGKILL when the parent (the pool) dies."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


class SubprocessSandbox(AgentSandbox):
    """An agent sandbox whose agent runs in a host child process (process, bwrap)."""

    backend_name = "process"

    def __init__(
        self,
        *args: object,
        proc: SpawnedProcess,
        dirs: list[str],
        stderr_tail: bytearray,
        **kwargs: object,
    ) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.proc = proc
        self.dirs = dirs
        self.stderr_tail = stderr_tail

    def record(self) -> SandboxRecord:
        return SandboxRecord(
            sandbox_id=self.sandbox_id,
            backend=self.backend_name,
            pid=self.proc.pid,
            pid_start_ticks=process_start_ticks(self.proc.pid),
            cgroup_paths=self.cgroup.dirs if self.cgroup else [],
            dirs=list(self.dirs),
        )

    async def _destroy(self) -> None:
        await self.conn.close()
        try:
            await asyncio.wait_for(self.proc.wait(), 1.0)
        except TimeoutError:
            self.proc.kill()
            await self.proc.wait()
        if self.proc.stderr_drain is not None:  # EOF follows the exit; let the task finish
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.proc.stderr_drain, 1.0)
        if self.cgroup is not None:
            await asyncio.to_thread(self.cgroup.kill_and_remove)
        for d in self.dirs:
            shutil.rmtree(d, ignore_errors=True)


async def _drain_stderr(stream: asyncio.StreamReader, tail: bytearray) -> None:
    while chunk := await stream.read(65536):
        tail.extend(chunk)
        del tail[:-STDERR_TAIL_BYTES]


# Sandboxes are spawned from these long-lived threads: the spawn (a fork + preexec_fn + exec for
# the process backend, a vfork + exec for bwrap's exec chain) blocks a spawner thread, not the
# event loop that is relaying other sandboxes' output. The threads live until the
# interpreter exits, which matters: PR_SET_PDEATHSIG (ours and bwrap's --die-with-parent) fires when
# the *thread* that forked the child ends.
_SPAWNER = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="sandbox-spawn")


class _WriteProtocol(asyncio.streams.FlowControlMixin):
    def __init__(self) -> None:
        super().__init__()
        self._closed = asyncio.get_running_loop().create_future()

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        if not self._closed.done():
            self._closed.set_result(None)

    def _get_close_waiter(self, stream: object) -> asyncio.Future[None]:
        return self._closed


class SpawnedProcess:
    """A child started by `subprocess.Popen` on a spawner thread; offers the calls of
    `asyncio.subprocess.Process` the sandboxes use (pid, returncode, wait, kill)."""

    def __init__(self, popen: subprocess.Popen[bytes]) -> None:
        self.popen = popen
        self.pid = popen.pid
        self.stderr_drain: asyncio.Task[None] | None = None

    @property
    def returncode(self) -> int | None:
        return self.popen.poll()

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()

    async def wait(self) -> int:
        if (rc := self.popen.poll()) is not None:
            return rc
        loop = asyncio.get_running_loop()
        fd = os.pidfd_open(self.pid)
        done = loop.create_future()
        loop.add_reader(fd, lambda: done.done() or done.set_result(None))
        try:
            await done
        finally:
            loop.remove_reader(fd)
            os.close(fd)
        return self.popen.wait()


async def start_agent_subprocess(
    argv: list[str],
    *,
    sandbox_id: str,
    template: SandboxTemplate,
    preexec_fn: Callable[[], None] | None = None,
    pass_fds: tuple[int, ...] = (),
) -> tuple[SpawnedProcess, AgentConnection, bytearray]:
    """Spawn the agent command, keep the last bytes of its stderr, wait for hello. Without a
    `preexec_fn` Popen can vfork (under a millisecond); a preexec_fn forces a fork, whose cost
    grows with this process's memory (15-23 ms with torch and a model loaded, GIL held)."""
    loop = asyncio.get_running_loop()
    popen = await loop.run_in_executor(
        _SPAWNER,
        functools.partial(
            subprocess.Popen,
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            bufsize=0,
            preexec_fn=preexec_fn,
            pass_fds=pass_fds,
            env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
        ),
    )
    proc = SpawnedProcess(popen)
    assert popen.stdin is not None and popen.stdout is not None and popen.stderr is not None
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), popen.stdout)
    err_reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(err_reader), popen.stderr)
    transport, protocol = await loop.connect_write_pipe(_WriteProtocol, popen.stdin)
    writer = asyncio.StreamWriter(transport, protocol, None, loop)
    tail = bytearray()
    drain = proc.stderr_drain = loop.create_task(_drain_stderr(err_reader, tail))
    drain.add_done_callback(lambda t: t.exception() if not t.cancelled() else None)
    conn = AgentConnection(reader, writer, name=sandbox_id)
    try:
        await conn.wait_hello(template.create_timeout_s)
    except SandboxBroken as e:
        proc.kill()
        await proc.wait()
        await asyncio.wait_for(drain, 2.0)
        raise SandboxBroken(
            f"{e}; exit {proc.returncode}; stderr: {bytes(tail).decode(errors='replace')[-1500:]!r}"
        ) from None
    return proc, conn, tail


class ProcessBackend(Backend):
    """Plain subprocess + rlimits. Development only: isolates nothing."""

    name = "process"
    isolating = False

    def __init__(self, state_dir: str | Path | None = None, journal: Journal | None = None) -> None:
        super().__init__(state_dir, journal)
        self.python = sys.executable

    async def create(
        self,
        template: SandboxTemplate,
        *,
        sandbox_id: str,
        cpus: tuple[int, ...] | None = None,
        mems: tuple[int, ...] | None = None,
    ) -> SubprocessSandbox:
        global _warned
        if not _warned:
            _warned = True
            log.warning(
                "sandbox backend 'process' is NOT isolation: commands run as this user on the host "
                "with full filesystem and network access. Use it for development only."
            )
        work = Path(tempfile.mkdtemp(prefix=f"{sandbox_id}-", dir=self._work_root()))
        record = SandboxRecord(sandbox_id=sandbox_id, backend=self.name, dirs=[str(work)])
        if self.journal:
            self.journal.write(record)
        memory_bytes = template.memory_mib << 20

        def preexec() -> None:
            set_pdeathsig()
            resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
            if cpus:
                os.sched_setaffinity(0, cpus)

        argv = [self.python, "-I", "-S", agent_source_path(), "--workdir", str(work)]
        try:
            proc, conn, tail = await start_agent_subprocess(
                argv, sandbox_id=sandbox_id, template=template, preexec_fn=preexec
            )
        except BaseException:
            shutil.rmtree(work, ignore_errors=True)
            if self.journal:
                self.journal.remove(sandbox_id)
            raise
        sb = SubprocessSandbox(
            sandbox_id,
            template,
            conn,
            cpus=cpus,
            mems=mems,
            journal=self.journal,
            proc=proc,
            dirs=[str(work)],
            stderr_tail=tail,
        )
        if self.journal:
            self.journal.write(sb.record())
        return sb

    @classmethod
    def probe(cls, boot: bool = False) -> tuple[bool, str]:
        ok, detail = super().probe(boot)
        return ok, detail + " (NOT isolation: development only)" if ok else detail

    def _work_root(self) -> Path:
        return private_dir(self.state_dir / "work", mode=0o700)  # ours alone: see rundir


__all__ = ["Cgroup", "ProcessBackend", "SubprocessSandbox", "start_agent_subprocess"]
