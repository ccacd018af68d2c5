"""The sandbox protocol: templates, exec results, `Sandbox`, `Backend`, and the backend factory.

Every backend runs the same guest agent (`guest/agent.py`) and drives it through an
`AgentConnection`; `AgentSandbox` implements the whole `Sandbox` protocol on top of that, so a
backend only has to start the agent (`Backend.create`) and tear it down (`AgentSandbox._destroy`).

`make_backend(name)` returns a backend by name; `qemu` and `firecracker` are imported lazily from
`slipstream.sandbox.qemu` / `.firecracker`, and a missing module is a `BackendUnavailable` error.

Not covered here: pooling and admission (pool.py), CPU sets (pinning.py), crash journal (journal.py).
"""

from __future__ import annotations

import abc
import asyncio
import importlib
import logging
import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from slipstream.sandbox.agent_client import AGENT_GRACE_S, AgentConnection, AgentExit
from slipstream.sandbox.errors import BackendUnavailable, SandboxBroken, SandboxError
from slipstream.sandbox.journal import Journal, SandboxRecord, default_state_dir, reap_record

if TYPE_CHECKING:
    from slipstream.config.sandbox import SandboxConfig
    from slipstream.sandbox.cgroups import Cgroup

log = logging.getLogger(__name__)

BACKEND_NAMES = ("process", "bwrap", "qemu", "firecracker")
DEFAULT_GET_MAX_BYTES = 16 << 20
PINNING_POLICIES = ("none", "core", "thread", "l3")
MEMORY_POLICIES = ("local", "interleave")


@dataclass(frozen=True)
class SandboxTemplate:
    """What every sandbox of a pool looks like. Hashable: the pool keys its warm sets by it."""

    backend: str = "bwrap"
    image: str | None = None
    """VM guest image directory (qemu/firecracker); None = the default built image."""
    vcpus: int = 1
    memory_mib: int = 512
    pinning: str = "none"
    memory_policy: str = "local"
    create_timeout_s: float = 60.0
    exec_timeout_s: float = 30.0
    pids_max: int = 256
    output_cap_bytes: int = 1 << 20
    workdir_mib: int = 256
    """Size of the sandbox's private writable tmpfs (bwrap); counts against memory_mib."""
    network: bool = False
    """Must stay False: no backend provides networking and asking for it is an error."""

    def __post_init__(self) -> None:
        if self.backend not in BACKEND_NAMES:
            raise ValueError(f"sandbox backend {self.backend!r} is not one of {BACKEND_NAMES}")
        if self.pinning not in PINNING_POLICIES:
            raise ValueError(f"sandbox pinning {self.pinning!r} is not one of {PINNING_POLICIES}")
        if self.memory_policy not in MEMORY_POLICIES:
            raise ValueError(
                f"memory_policy {self.memory_policy!r} is not one of {MEMORY_POLICIES}"
            )
        if self.network:
            raise ValueError("sandbox network=True is not supported: sandboxes have no network")
        minimums = {"vcpus": 1, "memory_mib": 16, "pids_max": 8, "workdir_mib": 1,
                    "output_cap_bytes": 1}  # fmt: skip
        for name, least in minimums.items():
            value = getattr(self, name)
            if type(value) is not int or value < least:
                raise ValueError(f"sandbox {name} = {value!r}: must be an integer >= {least}")
        for name in ("create_timeout_s", "exec_timeout_s"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise ValueError(f"sandbox {name} = {value!r}: must be a finite number > 0")

    @classmethod
    def from_config(cls, cfg: SandboxConfig, **overrides: Any) -> SandboxTemplate:
        """The template described by a `[sandbox]` config section."""
        fields = {
            k: getattr(cfg, k) for k in cls.__dataclass_fields__ if k in type(cfg).model_fields
        }
        return cls(**{**fields, **overrides})

    def with_(self, **changes: Any) -> SandboxTemplate:
        return replace(self, **changes)


@dataclass
class ExecResult:
    """One command's outcome. stdout/stderr are decoded UTF-8 (invalid bytes replaced), each capped
    at the template's output_cap_bytes (`*_truncated` says so). `exit_code` is negative -N when a
    signal N killed the command (as in `subprocess`). `peak_memory_bytes` is the cgroup's peak when
    the backend has a memory cgroup, else the command's max RSS."""

    exit_code: int | None
    stdout: str
    stderr: str
    truncated: bool = False
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    timed_out: bool = False
    oom_killed: bool = False
    wall_s: float = 0.0
    cpu_s: float = 0.0
    peak_memory_bytes: int | None = None
    signal: int | None = None

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out and not self.oom_killed

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class Sandbox(abc.ABC):
    """A live sandbox. Use from one asyncio task at a time."""

    sandbox_id: str
    template: SandboxTemplate
    cpus: tuple[int, ...] | None = None
    mems: tuple[int, ...] | None = None

    @abc.abstractmethod
    async def exec(
        self,
        argv: Sequence[str],
        stdin: bytes | str | None = None,
        files: Mapping[str, bytes | str] | None = None,
        env: Mapping[str, str] | None = None,
        timeout_s: float | None = None,
        cwd: str | None = None,
    ) -> ExecResult:
        """Run argv inside the sandbox (files are written into the work dir first). Raises
        SandboxBroken when the sandbox died; a failing command is a result, not an error."""

    @abc.abstractmethod
    async def put_file(
        self, path: str, data: bytes | str, mode: int | None = None, *,
        timeout_s: float | None = None,
    ) -> None:  # fmt: skip
        """Write a regular file (path relative to the work dir, which it may not leave).
        SandboxError when the path is a FIFO, device, socket, directory or symlink out;
        SandboxBroken when the agent does not answer within `timeout_s` (default: the
        template's exec_timeout_s)."""

    @abc.abstractmethod
    async def get_file(
        self, path: str, *, timeout_s: float | None = None, max_bytes: int | None = None
    ) -> bytes:
        """Read a regular file of at most `max_bytes` (default 16 MiB). SandboxError when it is
        missing, larger, or not a regular file (FIFO, device, socket, directory, symlink out:
        refused without blocking); SandboxBroken when the agent does not answer within
        `timeout_s` (default: the template's exec_timeout_s)."""

    @abc.abstractmethod
    async def reset(self) -> None:
        """Kill every process the sandbox's commands left and wipe the work dir."""

    @abc.abstractmethod
    async def ping(self) -> None:
        """Raise SandboxBroken unless the agent answers."""

    @abc.abstractmethod
    async def release(self) -> None:
        """Destroy the sandbox: processes, cgroups, dirs, VM. Idempotent."""

    @abc.abstractmethod
    def record(self) -> SandboxRecord: ...


def as_bytes(data: bytes | str) -> bytes:
    """File contents and stdin as bytes (a str is UTF-8)."""
    return data.encode() if isinstance(data, str) else data


def io_timeout_s(template: SandboxTemplate, timeout_s: float | None) -> float:
    """How long a file operation waits for the agent: by default no longer than a command may run
    (plus the grace the host gives the agent's own exec deadline); an explicit timeout as is."""
    return template.exec_timeout_s + AGENT_GRACE_S if timeout_s is None else timeout_s


class AgentSandbox(Sandbox):
    """A `Sandbox` whose commands run through a guest agent; optional cgroup adds OOM and peak
    memory facts. Subclasses implement `_destroy()` (and may extend `record()`)."""

    def __init__(
        self,
        sandbox_id: str,
        template: SandboxTemplate,
        conn: AgentConnection,
        *,
        cgroup: Cgroup | None = None,
        cpus: tuple[int, ...] | None = None,
        mems: tuple[int, ...] | None = None,
        journal: Journal | None = None,
    ) -> None:
        self.sandbox_id = sandbox_id
        self.journal = journal
        self.template = template
        self.conn = conn
        self.cgroup = cgroup
        self.cpus = cpus
        self.mems = mems
        self.released = False
        self.num_execs = 0

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.sandbox_id} cpus={self.cpus}>"

    async def exec(
        self,
        argv: Sequence[str],
        stdin: bytes | str | None = None,
        files: Mapping[str, bytes | str] | None = None,
        env: Mapping[str, str] | None = None,
        timeout_s: float | None = None,
        cwd: str | None = None,
    ) -> ExecResult:
        if self.released:
            raise SandboxError(f"{self.sandbox_id}: exec after release")
        if not argv:
            raise ValueError("exec needs a non-empty argv")
        timeout_s = self.template.exec_timeout_s if timeout_s is None else timeout_s
        oom_before = self.cgroup.oom_kills() if self.cgroup else 0
        if self.cgroup:
            self.cgroup.reset_peak_memory()
        self.num_execs += 1
        try:
            raw: AgentExit = await self.conn.exec(
                argv,
                stdin=as_bytes(stdin) if stdin is not None else b"",
                env=env,
                cwd=cwd,
                timeout_s=timeout_s,
                output_cap_bytes=self.template.output_cap_bytes,
                files={k: as_bytes(v) for k, v in files.items()} if files else None,
            )
        except SandboxBroken as e:
            oom = self.cgroup is not None and self.cgroup.oom_kills() > oom_before
            raise SandboxBroken(
                f"{e}{' (the memory cgroup OOM-killed it)' if oom else ''}"
            ) from None
        oom_killed = self.cgroup is not None and self.cgroup.oom_kills() > oom_before
        peak = self.cgroup.peak_memory_bytes() if self.cgroup else None
        return ExecResult(
            exit_code=raw.exit_code,
            stdout=raw.stdout.decode("utf-8", "replace"),
            stderr=raw.stderr.decode("utf-8", "replace"),
            truncated=raw.truncated,
            stdout_truncated=raw.stdout_truncated,
            stderr_truncated=raw.stderr_truncated,
            timed_out=raw.timed_out,
            oom_killed=oom_killed,
            wall_s=raw.wall_s,
            cpu_s=raw.cpu_s,
            peak_memory_bytes=peak if peak is not None else raw.max_rss_bytes,
            signal=raw.signal,
        )

    async def put_file(
        self, path: str, data: bytes | str, mode: int | None = None, *,
        timeout_s: float | None = None,
    ) -> None:  # fmt: skip
        if self.released:
            raise SandboxError(f"{self.sandbox_id}: put_file after release")
        await self.conn.put_file(
            path, as_bytes(data), mode, timeout_s=io_timeout_s(self.template, timeout_s)
        )

    async def get_file(
        self, path: str, *, timeout_s: float | None = None, max_bytes: int | None = None
    ) -> bytes:
        if self.released:
            raise SandboxError(f"{self.sandbox_id}: get_file after release")
        return await self.conn.get_file(
            path, max_bytes=DEFAULT_GET_MAX_BYTES if max_bytes is None else max_bytes,
            timeout_s=io_timeout_s(self.template, timeout_s),
        )  # fmt: skip

    async def reset(self) -> None:
        await self.conn.reset()

    async def ping(self) -> None:
        await self.conn.ping()

    async def release(self) -> None:
        if self.released:
            return
        self.released = True
        await self._destroy()
        if self.journal is not None:  # only after everything is gone: a crash before is reaped
            self.journal.remove(self.sandbox_id)

    @abc.abstractmethod
    async def _destroy(self) -> None:
        """Tear down everything this sandbox owns (called once)."""


class Backend(abc.ABC):
    """Creates sandboxes of one kind. `isolating` is False only for `process`.

    Constructor contract: every backend is built as `cls(state_dir=..., journal=...)` (what
    `make_backend` passes, the same for all); arguments of one backend alone (bwrap's uid,
    qemu's accel, ...) are keyword-only with defaults. `state_dir` (None: the user's default)
    holds work dirs and jails; `journal` (None: the caller records sandboxes) is written before
    a sandbox's processes start and emptied after it is destroyed."""

    name: str = ""
    isolating: bool = True

    def __init__(self, state_dir: str | Path | None = None, journal: Journal | None = None) -> None:
        self.state_dir = Path(state_dir) if state_dir else default_state_dir()
        self.journal = journal

    @abc.abstractmethod
    async def create(
        self,
        template: SandboxTemplate,
        *,
        sandbox_id: str,
        cpus: tuple[int, ...] | None = None,
        mems: tuple[int, ...] | None = None,
    ) -> AgentSandbox:
        """Start a sandbox and return it once its agent said hello. `cpus`/`mems`: the CPU and NUMA
        node sets chosen by the pool's pinning policy (None = unpinned)."""

    @classmethod
    def reap(cls, record: SandboxRecord) -> list[str]:
        """Remove what a crashed owner left of `record`; returns what was done (for logs).
        The default covers processes, cgroups and dirs (journal.reap_record); VM backends extend."""
        return reap_record(record)

    @classmethod
    def probe(cls, boot: bool = False) -> tuple[bool, str]:
        """Can this host run this backend's sandboxes? -> (ok, what works or why not), for
        `slipstream sandbox doctor`. The default creates one sandbox and runs a command in it;
        the VM backends check what they need instead (`boot=True`: qemu also boots a guest)."""

        async def run_one() -> str:
            sb = await cls().create(SandboxTemplate(backend=cls.name, memory_mib=128),
                                    sandbox_id=f"doctor-{os.getpid()}-{cls.name}")  # fmt: skip
            try:
                r = await sb.exec(["sh", "-c", "echo ok"], timeout_s=30)
            finally:
                await sb.release()
            if r.stdout != "ok\n":
                raise SandboxError(
                    f"echo gave {r.stdout!r} (exit {r.exit_code}, stderr {r.stderr!r:.200})"
                )
            agent = sb.conn.hello.get("python") if sb.conn.hello else "?"
            return f"spawned and ran a command; agent {agent}"

        try:
            return True, asyncio.run(run_one())
        except (BackendUnavailable, SandboxError, OSError) as e:
            return False, str(e)

    async def close(self) -> None:  # noqa: B027 (optional hook, deliberately not abstract)
        """Release backend-wide resources (none by default)."""


_LAZY_BACKENDS = {
    "process": ("slipstream.sandbox.process", "ProcessBackend"),
    "bwrap": ("slipstream.sandbox.bwrap", "BwrapBackend"),
    "qemu": ("slipstream.sandbox.qemu", "QemuBackend"),
    "firecracker": ("slipstream.sandbox.firecracker", "FirecrackerBackend"),
}


def backend_class(name: str) -> type[Backend]:
    """The backend class for `name`; BackendUnavailable if its module is not there."""
    if name not in _LAZY_BACKENDS:
        raise ValueError(f"unknown sandbox backend {name!r}; choose one of {BACKEND_NAMES}")
    module_name, cls_name = _LAZY_BACKENDS[name]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name == module_name:
            raise BackendUnavailable(
                f"sandbox backend {name!r} is not available: module {module_name} is missing"
            ) from None
        raise
    cls = getattr(module, cls_name, None)
    if cls is None:
        raise BackendUnavailable(f"sandbox backend {name!r}: {module_name} has no {cls_name}")
    return cls


def reaper_for(backend_name: str) -> Callable[[SandboxRecord], list[str]]:
    """How to reap a journal record of `backend_name`: its backend's `reap`, or the generic
    `journal.reap_record` (processes, cgroups, dirs) when that backend is unknown or missing."""
    try:
        return backend_class(backend_name).reap
    except (BackendUnavailable, ValueError):
        return reap_record


def make_backend(
    name: str, *, state_dir: str | Path | None = None, journal: Journal | None = None
) -> Backend:
    """The backend called `name` (process, bwrap, qemu, firecracker), built by the one
    constructor contract of `Backend` (`state_dir`, `journal`)."""
    return backend_class(name)(state_dir=state_dir, journal=journal)
