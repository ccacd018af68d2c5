"""The node's host agent (`slipstream sandbox serve`): one warm pool per node, leased to the
rollout workers on that node over a Unix socket (protocol: host_protocol.py).

Contract:
- One agent per state dir (an flock on `<state_dir>/agent.lock`) and per socket (a socket another
  process still answers on is refused, a stale one replaced). `start()` starts the `SandboxPool`
  (reaping the journal orphans of a crashed earlier agent: processes, cgroups, dirs), waits for
  the warm sandboxes, and only then binds the socket: the socket appearing means ready.
- Admission is the pool's (vCPUs x max_density, memory, pinning) and covers every client on the
  node: the sum of all leases, warm and dying sandboxes never exceeds it.
- `acquire` with `wait_s = 0` on a full host (nothing idle, created or destroyed, admission
  refuses) answers `no_capacity` at once; with `wait_s > 0` it waits at most
  min(wait_s, max_wait_s) for capacity (plus a sandbox creation when one is under way), and never
  more than `max_waiters` requests wait at once. Exec, file I/O, reset and ping are proxied
  to the leased sandbox's guest agent; the sandbox's cgroup facts (OOM kill, peak memory) are
  read here, where the privilege is.
- A session (connection) owns its leases: they end when it closes (a dead worker's kernel closes
  its socket), or when it sends nothing for `lease_ttl_s` (a frozen worker; the client's
  heartbeat renews every ttl/3). An ended lease's sandbox is destroyed, never reused; a later
  operation on it answers `expired`.
- `stop(drain_timeout_s)` (SIGTERM in the CLI) removes the socket (no new connections) and
  keeps serving the connected workers, new leases included, until they have all disconnected or
  the drain timeout passed; then every sandbox is destroyed and no process, cgroup or journal
  entry is left. Requests that arrive while the pool stops answer `stopping`.

Not covered: leases surviving an agent restart (the restarted agent reaps every sandbox; clients
see AgentUnavailable and lease again), per-client quotas or priorities (FIFO-ish among waiters),
several templates per agent, agents sharing one host's capacity with private pools.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from slipstream.rundir import private_dir
from slipstream.sandbox.agent_pool import open_pool
from slipstream.sandbox.base import AgentSandbox, Backend, SandboxTemplate
from slipstream.sandbox.errors import (
    AdmissionTimeout,
    AgentUnavailable,
    LeaseExpired,
    NoCapacity,
    SandboxBroken,
    SandboxError,
)
from slipstream.sandbox.host_ops import sandbox_op
from slipstream.sandbox.host_protocol import (
    PROTOCOL_VERSION,
    ProtocolError,
    encode_frame,
    positive_seconds,
    read_frame,
    template_from_dict,
    template_mismatch,
    template_to_dict,
)
from slipstream.sandbox.host_socket import (
    bind_socket,
    check_socket_free,
    peer_credentials,
    take_state_lock,
    unlink_socket,
)
from slipstream.sandbox.host_topology import Topology
from slipstream.sandbox.pinning import NoCpusFree
from slipstream.sandbox.pool import PoolOptions, SandboxPool

log = logging.getLogger(__name__)
HELLO_TIMEOUT_S = 10.0
EXPIRED_REMEMBERED = 1024  # per session: lease ids that expired, to say "expired" not "unknown"


@dataclass
class Lease:
    lease_id: str
    sandbox: AgentSandbox
    granted_at: float
    ops: int = 0  # operations in flight on it


@dataclass
class Session:
    sid: int
    peer_pid: int
    peer_uid: int
    writer: asyncio.StreamWriter
    name: str = ""
    last_seen: float = field(default_factory=time.monotonic)
    leases: dict[str, Lease] = field(default_factory=dict)
    ended: deque[str] = field(default_factory=lambda: deque(maxlen=EXPIRED_REMEMBERED))
    write_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    closed: bool = False

    def label(self) -> str:
        return f"session {self.sid} ({self.name or '?'}, pid {self.peer_pid}, uid {self.peer_uid})"


class HostAgent:
    """See the module docstring. Use `await start()` ... `await stop()` on one event loop."""

    def __init__(
        self,
        socket_path: str | Path,
        template: SandboxTemplate,
        options: PoolOptions | None = None,
        *,
        state_dir: str | Path,
        lease_ttl_s: float = 30.0,
        max_wait_s: float = 30.0,
        max_waiters: int | None = None,
        socket_mode: int = 0o660,
        socket_gid: int | None = None,
        allowed_uids: set[int] | None = None,
        backend: Backend | None = None,
        topology: Topology | None = None,
    ) -> None:
        positive_seconds(lease_ttl_s, "lease_ttl_s")
        positive_seconds(max_wait_s, "max_wait_s", allow_zero=True)
        if max_waiters is not None and max_waiters < 0:
            raise ValueError(f"max_waiters = {max_waiters}: must be >= 0")
        self.socket_path = Path(socket_path)
        self.template = template
        self.options = options or PoolOptions()
        self.state_dir = Path(state_dir)
        self.lease_ttl_s = lease_ttl_s
        self.max_wait_s = max_wait_s
        self.max_waiters = max_waiters
        self.socket_mode = socket_mode
        self.socket_gid = socket_gid
        self.allowed_uids = allowed_uids
        self._backend = backend
        self._topology = topology
        self.pool: SandboxPool | None = None
        self._server: asyncio.base_events.Server | None = None
        self._socket_ino: int | None = None
        self._lock_fd: int | None = None
        self._sessions: dict[int, Session] = {}
        self._next_sid = 1
        self._waiting = 0
        self._draining = False
        self._expiry_task: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.counts = {"sessions": 0, "leases_granted": 0, "leases_released": 0,
                       "leases_expired": 0, "leases_ended_on_disconnect": 0, "no_capacity": 0,
                       "forbidden": 0, "max_in_use": 0}  # fmt: skip

    # ------------------------------------------------------------ lifecycle

    async def start(self, ready_timeout_s: float | None = None) -> HostAgent:
        private_dir(self.state_dir, mode=0o755)  # ours, not writable by others (rundir)
        self._lock_fd = take_state_lock(self.state_dir)
        try:
            check_socket_free(self.socket_path)
            pool = open_pool(self.template, self.options, backend=self._backend,
                             state_dir=self.state_dir, topology=self._topology)  # fmt: skip
            self.pool = pool
            await pool.start()
            if reaped := pool.stats().orphans_reaped:
                log.warning("host agent: reaped %d orphaned sandboxes", reaped)
            if self.options.min_idle:
                timeout = (
                    self.template.create_timeout_s if ready_timeout_s is None else ready_timeout_s
                )
                try:
                    await pool.wait_ready(timeout)
                except TimeoutError:
                    raise SandboxError(
                        f"host agent: no warm {self.template.backend} sandbox within {timeout} s "
                        f"({pool.stats()}); see `slipstream sandbox doctor`"
                    ) from None
            sock = bind_socket(self.socket_path, self.socket_mode, self.socket_gid)
            self._socket_ino = os.lstat(self.socket_path).st_ino
            self._server = await asyncio.start_unix_server(self._on_client, sock=sock)
        except BaseException:
            await self._teardown()
            raise
        self._expiry_task = asyncio.get_running_loop().create_task(self._expiry_loop())
        log.info("host agent serving unix://%s (%s)", self.socket_path, self.pool.admission_state())
        return self

    async def stop(self, drain_timeout_s: float = 0.0) -> None:
        """Drain, then destroy everything. Draining: no new connections (the socket is removed
        at once, so a replacement agent can bind it), while the connected workers are served as
        usual, new leases included, so that a worker draining for a Spot interruption can
        finish its in-flight tasks; it ends when no worker is connected or after
        drain_timeout_s. Idempotent."""
        self._draining = True
        if self._server is not None:
            self._server.close()
            self._server = None
        unlink_socket(self.socket_path, self._socket_ino)
        self._socket_ino = None
        deadline = time.monotonic() + drain_timeout_s
        while self._sessions and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self._sessions:
            log.warning("host agent stop: %d clients still connected, %d leases held; destroying "
                        "them", len(self._sessions), self._in_use())  # fmt: skip
        await self._teardown()

    async def _teardown(self) -> None:
        if self._expiry_task:
            self._expiry_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._expiry_task
            self._expiry_task = None
        if self._server is not None:
            self._server.close()
            self._server = None
        unlink_socket(self.socket_path, self._socket_ino)
        self._socket_ino = None
        for s in list(self._sessions.values()):
            await self._close_session(s, "agent stopping")
        if self.pool is not None:  # wakes waiting acquires too: they fail with "pool is stopping"
            await self.pool.stop()
        if self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = None

    # ------------------------------------------------------------ sessions

    async def _on_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            pid, uid, _gid = peer_credentials(writer.get_extra_info("socket"))
        except OSError as e:
            log.warning("host agent: no peer credentials for a connection (%s); closing it", e)
            writer.close()
            return
        session = Session(self._next_sid, pid, uid, writer)
        self._next_sid += 1
        try:
            if not await self._hello(session, reader):
                return
            self._sessions[session.sid] = session
            self.counts["sessions"] += 1
            while True:
                try:
                    msg = await read_frame(reader)
                except (asyncio.IncompleteReadError, ConnectionError):
                    break
                except ProtocolError as e:
                    log.warning(
                        "host agent: %s sent a bad frame (%s); closing it", session.label(), e
                    )
                    break
                session.last_seen = time.monotonic()
                rid = msg.get("id")
                if type(rid) is not int:
                    log.warning(
                        "host agent: %s sent a frame without an integer id", session.label()
                    )
                    break
                task = asyncio.get_running_loop().create_task(self._handle(session, rid, msg))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
        finally:
            await self._close_session(session, "disconnected")

    async def _hello(self, session: Session, reader: asyncio.StreamReader) -> bool:
        try:
            msg = await asyncio.wait_for(read_frame(reader), HELLO_TIMEOUT_S)
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError, ProtocolError):
            return False
        rid = msg.get("id")

        async def refuse(code: str, why: str) -> bool:
            await self._send(session, {"type": "error", "id": rid, "code": code, "error": why})
            log.warning("host agent: refused %s: %s", session.label(), why)
            return False

        if msg.get("type") != "hello":
            return await refuse(
                "bad_request", f"first request must be hello, got {msg.get('type')!r}"
            )
        session.name = str(msg.get("name", ""))[:100]
        if self.allowed_uids is not None and session.peer_uid not in self.allowed_uids:
            self.counts["forbidden"] += 1
            return await refuse("forbidden", f"uid {session.peer_uid} may not lease sandboxes here")
        if msg.get("version") != PROTOCOL_VERSION:
            return await refuse("version", f"protocol version {msg.get('version')!r} is not "
                                f"{PROTOCOL_VERSION}: client and agent are different releases")  # fmt: skip
        if msg.get("template") is not None:
            try:
                wanted = template_from_dict(msg["template"])
            except ProtocolError as e:
                return await refuse("bad_request", str(e))
            diff = template_mismatch(self.template, wanted)
            if diff:
                return await refuse("template_mismatch", "the agent serves another sandbox "
                                    f"template ({'; '.join(diff)}); run both from one [sandbox] config")  # fmt: skip
        assert self.pool is not None
        await self._send(session, {
            "type": "ok", "id": rid, "version": PROTOCOL_VERSION, "agent_pid": os.getpid(),
            "template": template_to_dict(self.template), "lease_ttl_s": self.lease_ttl_s,
            "max_wait_s": self.max_wait_s, "vcpu_capacity": self.pool.vcpu_capacity,
            "stats": self.stats(),
        })  # fmt: skip
        return True

    async def _send(self, session: Session, msg: dict[str, Any]) -> None:
        if session.closed:
            return
        async with session.write_lock:
            try:
                session.writer.write(encode_frame(msg))
                await session.writer.drain()
            except (ConnectionError, OSError):
                session.closed = True

    async def _close_session(self, session: Session, why: str) -> None:
        if self._sessions.pop(session.sid, None) is None and session.closed:
            return
        session.closed = True
        for lease in list(session.leases.values()):
            self.counts["leases_ended_on_disconnect"] += 1
            await self._end_lease(session, lease, reuse=False, why=why)
        session.writer.close()
        with contextlib.suppress(ConnectionError, OSError):
            await session.writer.wait_closed()

    async def _end_lease(
        self, session: Session, lease: Lease, *, reuse: bool | None, why: str
    ) -> None:
        """Take the lease from its session and give the sandbox back (destroyed unless reuse is
        asked for and no operation is in flight on it)."""
        if session.leases.pop(lease.lease_id, None) is None:
            return
        session.ended.append(lease.lease_id)
        if why != "released":
            log.warning(
                "host agent: lease %s of %s ended: %s", lease.lease_id, session.label(), why
            )
        assert self.pool is not None
        try:
            await self.pool.release(lease.sandbox, reuse=reuse if lease.ops == 0 else False)
        except SandboxError as e:  # the pool stopped under it: the sandbox is gone already
            log.debug("host agent: release of %s: %s", lease.sandbox, e)

    async def _expiry_loop(self) -> None:
        while True:
            await asyncio.sleep(min(1.0, self.lease_ttl_s / 4))
            now = time.monotonic()
            for s in list(self._sessions.values()):
                if s.leases and now - s.last_seen > self.lease_ttl_s:
                    why = f"expired: nothing from the client for {now - s.last_seen:.1f} s > ttl {self.lease_ttl_s:g} s"
                    for lease in list(s.leases.values()):
                        self.counts["leases_expired"] += 1
                        await self._end_lease(s, lease, reuse=False, why=why)

    def _in_use(self) -> int:
        return sum(len(s.leases) for s in self._sessions.values())

    # ------------------------------------------------------------ requests

    async def _handle(self, session: Session, rid: int, msg: dict[str, Any]) -> None:
        kind = msg.get("type")
        try:
            body = await self._dispatch(session, kind, msg)
            reply = {"type": "ok", "id": rid, **body}
        except NoCapacity as e:
            self.counts["no_capacity"] += 1
            reply = _error(rid, "no_capacity", e)
        except AgentUnavailable as e:
            reply = _error(rid, "stopping", e)
        except LeaseExpired as e:
            reply = _error(rid, "expired", e)
        except SandboxBroken as e:
            reply = _error(rid, "broken", e)
        except _UnknownLease as e:
            reply = _error(rid, "unknown_lease", e)
        except (ProtocolError, KeyError, TypeError) as e:
            reply = _error(rid, "bad_request", f"{kind}: {type(e).__name__}: {e}")
        except (SandboxError, OSError, NoCpusFree, ValueError) as e:
            reply = _error(rid, "sandbox_error", e)
        await self._send(session, reply)

    def _lease(self, session: Session, msg: dict[str, Any]) -> Lease:
        lid = msg.get("lease")
        lease = session.leases.get(lid) if isinstance(lid, str) else None
        if lease is None:
            if lid in session.ended:
                raise LeaseExpired(f"lease {lid} has ended (expired, or its sandbox broke); "
                                   "its sandbox was destroyed")  # fmt: skip
            raise _UnknownLease(f"lease {lid!r} is not held by this session")
        return lease

    async def _dispatch(
        self, session: Session, kind: object, msg: dict[str, Any]
    ) -> dict[str, Any]:
        if kind == "acquire":
            return await self._acquire(session, msg)
        if kind == "release":
            lease = self._lease(session, msg)
            reuse = msg.get("reuse")
            if reuse is not None and not isinstance(reuse, bool):
                raise ProtocolError("release: reuse must be true, false or null")
            self.counts["leases_released"] += 1
            await self._end_lease(session, lease, reuse=reuse, why="released")
            return {}
        if kind in ("exec", "put_file", "get_file", "reset", "ping"):
            lease = self._lease(session, msg)
            lease.ops += 1
            try:
                return await sandbox_op(kind, lease.sandbox, msg)
            except SandboxBroken as e:
                if lease.lease_id in session.ended:  # expired or disconnected under the op
                    raise LeaseExpired(f"lease {lease.lease_id} ended during {kind}: {e}") from None
                await self._end_lease(session, lease, reuse=False, why=f"sandbox broke: {e}")
                raise
            finally:
                lease.ops -= 1
        if kind == "renew":
            return {"stats": self.stats()}
        if kind == "stats":
            return {"stats": self.stats()}
        if kind == "wait_ready":
            assert self.pool is not None
            timeout = min(positive_seconds(msg.get("timeout_s", 0), "timeout_s", allow_zero=True),
                          self.max_wait_s)  # fmt: skip
            try:
                await self.pool.wait_ready(timeout)
            except TimeoutError:
                raise NoCapacity(
                    f"pool not ready within {timeout} s: {self.pool.admission_state()}"
                ) from None
            return {}
        raise ProtocolError(f"unknown request type {kind!r}")

    async def _acquire(self, session: Session, msg: dict[str, Any]) -> dict[str, Any]:
        pool = self.pool
        assert pool is not None
        if pool.stopping:
            raise AgentUnavailable("the host agent is stopping: no new leases")
        wait_s = min(
            positive_seconds(msg.get("wait_s", 0), "wait_s", allow_zero=True), self.max_wait_s
        )
        full = pool.full()
        if full and wait_s == 0:
            raise NoCapacity(f"host full: {pool.admission_state()}")
        if self.max_waiters is not None and self._waiting >= self.max_waiters:
            raise NoCapacity(f"{self._waiting} acquires already waiting (max_waiters "
                             f"{self.max_waiters}): {pool.admission_state()}")  # fmt: skip
        # Capacity exists (or will, once a dying sandbox is gone): allow a creation's time too.
        timeout_s = wait_s if full else max(wait_s, self.template.create_timeout_s)
        self._waiting += 1
        try:
            sb = await pool.acquire(timeout_s=timeout_s)
        except AdmissionTimeout as e:
            raise NoCapacity(f"no capacity within {timeout_s:g} s: {e}") from None
        except SandboxError as e:
            if pool.stopping:
                raise AgentUnavailable(f"the host agent is stopping: {e}") from None
            raise
        finally:
            self._waiting -= 1
        if session.closed:  # the client left while it waited: give the sandbox back, unused
            await pool.release(sb, reuse=True)
            raise AgentUnavailable("session closed while acquiring")
        lease = Lease(secrets.token_hex(12), sb, time.monotonic())
        session.leases[lease.lease_id] = lease
        self.counts["leases_granted"] += 1
        self.counts["max_in_use"] = max(self.counts["max_in_use"], self._in_use())
        return {"lease": lease.lease_id, "sandbox_id": sb.sandbox_id,
                "cpus": list(sb.cpus) if sb.cpus else None,
                "mems": list(sb.mems) if sb.mems else None}  # fmt: skip

    # ------------------------------------------------------------ stats

    def stats(self) -> dict[str, Any]:
        """The pool's stats plus the agent's counts (sessions, leases, no-capacity answers)."""
        assert self.pool is not None
        return {
            "pool": asdict(self.pool.stats()),
            **self.counts,
            "sessions_open": len(self._sessions),
            "in_use": self._in_use(),
            "waiting": self._waiting,
            "draining": self._draining,
            "lease_ttl_s": self.lease_ttl_s,
            "admission": self.pool.admission_state(),
        }


class _UnknownLease(SandboxError):
    pass


def _error(rid: int, code: str, e: object) -> dict[str, Any]:
    return {"type": "error", "id": rid, "code": code, "error": str(e)[:2000]}
