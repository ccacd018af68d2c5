"""The client side of the node's host agent, and the factory that picks a pool.

`AgentPool(url, template, options)` is a `Pool` (pool.py), as `SandboxPool` is: `start()` /
`async with`, `wait_ready`, `acquire(timeout_s)`, `release(sb, reuse=None)`, `sandbox()`,
`stats()`, `stop()`. Its sandboxes (`LeasedSandbox`) implement the `Sandbox` protocol; every operation is proxied through the agent (host_protocol.py), which owns the
sandboxes, their cgroups and the journal.

Contract:
- `start()` connects (retrying while the socket is missing or refuses, up to
  `connect_timeout_s`), says hello with the template it expects (the agent refuses a different
  one, naming the fields), and starts a heartbeat that renews its leases every ttl/3.
- `acquire(timeout_s)` asks for a lease, waiting at most `timeout_s` (default
  `options.acquire_timeout_s`; the agent caps it at its max_wait_s) for capacity; a full host
  raises `NoCapacity` (`timeout_s=0`: at once). An unreachable or lost agent raises
  `AgentUnavailable`; the next call reconnects. Both are `SandboxError`s and infrastructure
  failures, not verdicts.
- When the connection is lost (agent killed or restarted), every sandbox leased through it is
  gone: its operations raise `AgentUnavailable` (a `SandboxBroken`), its release is a no-op.
- `stats()` is synchronous: this client's acquires, in-use count and acquire waits (measured
  here, round trip included) plus the agent-wide counts of the last heartbeat.
- `stop()` releases (destroys) every sandbox this client still holds and closes the connection.

`make_pool(sandbox_cfg, agent_url)` / `open_pool(template, options, ...)`: the one factory of
pools, which every caller uses: an `AgentPool` when an agent URL (`unix:///path`) is given, else
the in-process `SandboxPool` (the embedded default; the host agent's own pool).

Not covered: use from several event loops (one AgentPool per loop), exec output streaming
(results come back whole, capped by output_cap_bytes), leases that survive an agent restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import fields
from typing import TYPE_CHECKING, Any, Literal, Self, overload

from slipstream.sandbox.agent_client import AGENT_GRACE_S
from slipstream.sandbox.base import (
    DEFAULT_GET_MAX_BYTES,
    ExecResult,
    Sandbox,
    SandboxTemplate,
    as_bytes,
    io_timeout_s,
)
from slipstream.sandbox.errors import AgentUnavailable, NoCapacity, SandboxBroken, SandboxError
from slipstream.sandbox.host_protocol import (
    PROTOCOL_VERSION,
    ProtocolError,
    b64d,
    b64e,
    encode_frame,
    error_from_reply,
    exec_result_from_dict,
    parse_agent_url,
    read_frame,
    template_from_dict,
    template_to_dict,
)
from slipstream.sandbox.journal import SandboxRecord
from slipstream.sandbox.pool import Pool, PoolOptions, PoolStats, SandboxPool, percentile

if TYPE_CHECKING:
    from pathlib import Path

    from slipstream.config.sandbox import SandboxConfig
    from slipstream.sandbox.base import Backend
    from slipstream.sandbox.host_topology import Topology

log = logging.getLogger(__name__)
PROXY_GRACE_S = 10.0  # beyond the agent's own bounds: a loaded host, one more hop
CONTROL_TIMEOUT_S = 15.0


class _Connection:
    """One session with the agent: a reader task resolving replies by id."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, epoch: int):
        self.reader, self.writer, self.epoch = reader, writer, epoch
        self.pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self.next_id = 1
        self.lost: str | None = None
        self.write_lock = asyncio.Lock()
        self.reader_task: asyncio.Task[None] | None = None
        self.hello: dict[str, Any] = {}


class LeasedSandbox(Sandbox):
    """A sandbox leased from the host agent; every call goes through the agent."""

    def __init__(self, pool: AgentPool, lease_id: str, sandbox_id: str, epoch: int,
                 cpus: Sequence[int] | None, mems: Sequence[int] | None) -> None:  # fmt: skip
        self.pool = pool
        self.lease_id = lease_id
        self.sandbox_id = sandbox_id
        self.template = pool.template
        self.epoch = epoch
        self.cpus = tuple(cpus) if cpus else None
        self.mems = tuple(mems) if mems else None
        self.released = False
        self.broken: SandboxBroken | None = None

    def __repr__(self) -> str:
        return f"<LeasedSandbox {self.sandbox_id} lease={self.lease_id[:8]} cpus={self.cpus}>"

    async def _op(self, kind: str, fields_: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        if self.released:
            raise SandboxError(f"{self.sandbox_id}: {kind} after release")
        if self.broken is not None:  # the same error again (AgentUnavailable, LeaseExpired...)
            raise type(self.broken)(f"{self.sandbox_id}: {self.broken}")
        try:
            return await self.pool._call(kind, {"lease": self.lease_id, **fields_}, timeout_s,
                                         epoch=self.epoch)  # fmt: skip
        except SandboxBroken as e:  # the agent ended the lease (broken, expired) or is gone
            self.broken = e
            raise

    async def exec(
        self,
        argv: Sequence[str],
        stdin: bytes | str | None = None,
        files: Mapping[str, bytes | str] | None = None,
        env: Mapping[str, str] | None = None,
        timeout_s: float | None = None,
        cwd: str | None = None,
    ) -> ExecResult:
        if not argv:
            raise ValueError("exec needs a non-empty argv")
        timeout_s = self.template.exec_timeout_s if timeout_s is None else timeout_s
        msg: dict[str, Any] = {"argv": list(argv), "timeout_s": timeout_s}
        if stdin is not None:
            msg["stdin_b64"] = b64e(as_bytes(stdin))
        if files:
            msg["files"] = {k: b64e(as_bytes(v)) for k, v in files.items()}
        if env:
            msg["env"] = dict(env)
        if cwd:
            msg["cwd"] = cwd
        reply = await self._op("exec", msg, timeout_s + AGENT_GRACE_S + PROXY_GRACE_S)
        return exec_result_from_dict(reply["result"])

    def _io_timeout_s(self, timeout_s: float | None) -> float:
        return io_timeout_s(self.template, timeout_s) + PROXY_GRACE_S

    async def put_file(
        self, path: str, data: bytes | str, mode: int | None = None, *,
        timeout_s: float | None = None,
    ) -> None:  # fmt: skip
        msg: dict[str, Any] = {"path": path, "data_b64": b64e(as_bytes(data)), "mode": mode,
                               "timeout_s": timeout_s}  # fmt: skip
        await self._op("put_file", msg, self._io_timeout_s(timeout_s))

    async def get_file(
        self, path: str, *, timeout_s: float | None = None, max_bytes: int | None = None
    ) -> bytes:
        msg = {"path": path, "timeout_s": timeout_s,
               "max_bytes": DEFAULT_GET_MAX_BYTES if max_bytes is None else max_bytes}  # fmt: skip
        reply = await self._op("get_file", msg, self._io_timeout_s(timeout_s))
        return b64d(reply["data_b64"], "data_b64")

    async def reset(self) -> None:
        await self._op("reset", {}, self._io_timeout_s(None))

    async def ping(self) -> None:
        await self._op("ping", {}, CONTROL_TIMEOUT_S)

    async def release(self) -> None:
        """Destroy the sandbox (never reused). Idempotent."""
        if not self.released:
            await self.pool.release(self, reuse=False)

    def record(self) -> SandboxRecord:
        return SandboxRecord(sandbox_id=self.sandbox_id, backend=self.template.backend,
                             extra={"lease": self.lease_id, "agent": self.pool.url})  # fmt: skip


class AgentPool(Pool):
    """A `Pool` whose sandboxes are leased from the node's host agent."""

    def __init__(
        self,
        url: str,
        template: SandboxTemplate | None = None,
        options: PoolOptions | None = None,
        *,
        name: str | None = None,
        connect_timeout_s: float | None = None,
    ) -> None:
        self.url = url
        self.socket_path = parse_agent_url(url)
        self.template = template or SandboxTemplate()
        self._check_template = template is not None
        self.opts = options or PoolOptions()
        self.name = name or f"pid-{os.getpid()}"
        self.connect_timeout_s = connect_timeout_s or self.template.create_timeout_s
        self.lease_ttl_s: float | None = None
        self._conn: _Connection | None = None
        self._epoch = 0
        self._connect_lock = asyncio.Lock()
        self._heartbeat: asyncio.Task[None] | None = None
        self._held: dict[str, LeasedSandbox] = {}
        self._waits_s: deque[float] = deque(maxlen=100_000)
        self._acquires = 0
        self._agent_stats: dict[str, Any] = {}
        self._stopped = False

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> Self:
        await self._ensure_connected(self.connect_timeout_s)
        return self

    async def wait_ready(self, timeout_s: float = 60.0) -> None:
        """Until the agent's pool has its warm sandboxes (TimeoutError otherwise)."""
        try:
            await self._call("wait_ready", {"timeout_s": timeout_s}, timeout_s + PROXY_GRACE_S)
        except NoCapacity as e:  # the agent's answer when its pool is not ready in time
            raise TimeoutError(str(e)) from None

    async def stop(self) -> None:
        """Release every sandbox still held and close the connection. Idempotent."""
        self._stopped = True
        for sb in list(self._held.values()):
            with contextlib.suppress(SandboxError):
                await self.release(sb, reuse=False)
        if self._heartbeat is not None:
            self._heartbeat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._heartbeat
            self._heartbeat = None
        if self._conn is not None:
            await self._drop(self._conn, "closed by the client")

    # ------------------------------------------------------------ connection

    async def _ensure_connected(self, timeout_s: float) -> _Connection:
        if self._stopped:
            raise SandboxError(f"agent pool {self.url} is stopped")
        async with self._connect_lock:
            if self._conn is not None and self._conn.lost is None:
                return self._conn
            deadline = time.monotonic() + timeout_s
            while True:
                try:
                    reader, writer = await asyncio.open_unix_connection(self.socket_path)
                    break
                except (FileNotFoundError, ConnectionRefusedError) as e:
                    if time.monotonic() >= deadline:
                        raise AgentUnavailable(
                            f"no host agent at {self.url} within {timeout_s:g} s ({e.strerror}); "
                            "is `slipstream sandbox serve` running on this node?"
                        ) from None
                    await asyncio.sleep(0.1)
                except OSError as e:  # EACCES: this uid may not use the socket
                    raise AgentUnavailable(
                        f"cannot connect to the host agent at {self.url}: {e}"
                    ) from None
            self._epoch += 1
            conn = _Connection(reader, writer, self._epoch)
            conn.reader_task = asyncio.get_running_loop().create_task(self._read_loop(conn))
            self._conn = conn
            hello = {"name": self.name, "pid": os.getpid(), "version": PROTOCOL_VERSION,
                     "template": template_to_dict(self.template) if self._check_template else None}  # fmt: skip
            try:
                reply = await self._call("hello", hello, CONTROL_TIMEOUT_S, conn=conn)
            except SandboxError:
                await self._drop(conn, "hello refused")
                raise
            conn.hello = reply
            self._agent_stats = reply.get("stats", {})
            agent_t = template_from_dict(reply["template"])
            if not self._check_template:  # take the agent's; keep our own timeouts otherwise
                self.template = agent_t
            self.lease_ttl_s = float(reply["lease_ttl_s"])
            if self._heartbeat is None or self._heartbeat.done():
                self._heartbeat = asyncio.get_running_loop().create_task(self._heartbeat_loop())
            return conn

    async def _read_loop(self, conn: _Connection) -> None:
        why = "the host agent closed the connection"
        try:
            while True:
                msg = await read_frame(conn.reader)
                fut = conn.pending.pop(msg.get("id"), None)  # type: ignore[arg-type]
                if fut is not None and not fut.done():
                    fut.set_result(msg)
                elif msg.get("type") == "ok" and isinstance(msg.get("lease"), str):
                    # a grant whose caller gave up (timed out, cancelled): give it back
                    self._spawn_release(conn, msg["lease"])
        except (asyncio.IncompleteReadError, ConnectionError, OSError) as e:
            why = f"connection to the host agent lost ({type(e).__name__})"
        except ProtocolError as e:
            why = f"the host agent sent a bad frame: {e}"
        conn.lost = why
        for fut in conn.pending.values():
            if not fut.done():
                fut.set_exception(AgentUnavailable(f"{self.url}: {why}"))
        conn.pending.clear()

    def _spawn_release(self, conn: _Connection, lease_id: str) -> None:
        async def give_back() -> None:
            with contextlib.suppress(SandboxError):
                await self._call("release", {"lease": lease_id, "reuse": None}, CONTROL_TIMEOUT_S,
                                 conn=conn)  # fmt: skip

        asyncio.get_running_loop().create_task(give_back())

    async def _drop(self, conn: _Connection, why: str) -> None:
        conn.lost = conn.lost or why
        conn.writer.close()
        with contextlib.suppress(ConnectionError, OSError):
            await conn.writer.wait_closed()
        if conn.reader_task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await conn.reader_task

    async def _heartbeat_loop(self) -> None:
        while not self._stopped:
            await asyncio.sleep((self.lease_ttl_s or 30.0) / 3)
            conn = self._conn
            if conn is None or conn.lost is not None:
                continue
            try:
                reply = await self._call("renew", {}, CONTROL_TIMEOUT_S, conn=conn)
            except SandboxError as e:
                log.debug("agent pool %s: heartbeat failed: %s", self.url, e)
                continue
            self._agent_stats = reply.get("stats", {})

    async def _call(
        self, kind: str, body: dict[str, Any], timeout_s: float, *,
        conn: _Connection | None = None, epoch: int | None = None,
    ) -> dict[str, Any]:  # fmt: skip
        """Send one request and wait for its reply; raise the error the reply names."""
        if conn is None:
            if epoch is not None:  # a lease op: only on the connection that granted it
                conn = self._conn
                if conn is None or conn.epoch != epoch or conn.lost is not None:
                    why = conn.lost if conn is not None and conn.epoch == epoch else "reconnected"
                    raise AgentUnavailable(
                        f"{self.url}: the agent connection that leased this sandbox is gone "
                        f"({why}); the sandbox is gone with it"
                    )
            else:
                conn = await self._ensure_connected(min(timeout_s, self.connect_timeout_s))
        if conn.lost is not None:
            raise AgentUnavailable(f"{self.url}: {conn.lost}")
        rid = conn.next_id
        conn.next_id += 1
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        conn.pending[rid] = fut
        try:
            async with conn.write_lock:
                conn.writer.write(encode_frame({"type": kind, "id": rid, **body}))
                await conn.writer.drain()
            reply = await asyncio.wait_for(fut, timeout_s)
        except TimeoutError:
            raise AgentUnavailable(
                f"{self.url}: no reply to {kind} within {timeout_s:g} s"
            ) from None
        except (ConnectionError, OSError) as e:
            conn.lost = conn.lost or f"write failed ({type(e).__name__})"
            raise AgentUnavailable(f"{self.url}: cannot send {kind}: {e}") from None
        finally:
            conn.pending.pop(rid, None)
        if reply.get("type") == "error":
            raise error_from_reply(reply, kind)
        return reply

    # ------------------------------------------------------------ hand-out

    async def acquire(self, timeout_s: float | None = None) -> LeasedSandbox:
        wait_s = self.opts.acquire_timeout_s if timeout_s is None else timeout_s
        t0 = time.perf_counter()
        budget = wait_s + self.template.create_timeout_s + PROXY_GRACE_S
        conn = await self._ensure_connected(min(budget, self.connect_timeout_s))
        reply = await self._call("acquire", {"wait_s": wait_s}, budget, conn=conn)
        sb = LeasedSandbox(self, reply["lease"], reply["sandbox_id"], conn.epoch,
                           reply.get("cpus"), reply.get("mems"))  # fmt: skip
        self._held[sb.lease_id] = sb
        self._acquires += 1
        self._waits_s.append(time.perf_counter() - t0)
        return sb

    async def release(self, sb: Sandbox, *, reuse: bool | None = None) -> None:
        """Give the lease back: destroyed (single use) or reset and reused, as the agent's
        options say unless `reuse` is given. A sandbox whose connection is gone is gone."""
        if not isinstance(sb, LeasedSandbox) or self._held.pop(sb.lease_id, None) is None:
            raise SandboxError(f"{sb} was not acquired from this pool")
        sb.released = True
        if sb.broken is not None:  # the agent ended the lease already
            return
        try:
            await self._call("release", {"lease": sb.lease_id, "reuse": reuse}, CONTROL_TIMEOUT_S,
                             epoch=sb.epoch)  # fmt: skip
        except SandboxBroken as e:  # expired, or the agent is gone: nothing is left to release
            log.debug("agent pool: release of %s: %s", sb, e)

    # ------------------------------------------------------------ stats

    async def agent_stats(self) -> dict[str, Any]:
        """The agent's stats now (pool, sessions, leases, no-capacity answers)."""
        reply = await self._call("stats", {}, CONTROL_TIMEOUT_S)
        self._agent_stats = reply["stats"]
        return self._agent_stats

    def stats(self) -> PoolStats:
        """This client's acquires, in-use count and waits; agent-wide counts as of the last
        heartbeat (or `agent_stats()` call)."""
        waits = list(self._waits_s)
        pool = self._agent_stats.get("pool", {})
        known = {f.name for f in fields(PoolStats)}
        agent = {k: v for k, v in pool.items() if k in known}
        notes = list(agent.pop("notes", []))
        notes.append(f"leased from the host agent {self.url}: in_use, acquires and waits are this "
                     "client's; the other counts are the agent's, as of its last heartbeat")  # fmt: skip
        base = {"live": 0, "idle": 0, "creating": 0, "created": 0, "destroyed": 0,
                "create_failures": 0, "health_failures": 0, "vcpu_capacity": 0.0,
                "pinning": self.template.pinning}  # fmt: skip
        base.update({k: v for k, v in agent.items() if k in base})
        return PoolStats(**base, in_use=len(self._held), acquires=self._acquires,
                         acquire_wait_p50_s=percentile(waits, 0.5),
                         acquire_wait_p99_s=percentile(waits, 0.99), notes=notes)  # fmt: skip


@overload
def open_pool(
    template: SandboxTemplate,
    options: PoolOptions | None = None,
    *,
    state_dir: str | Path | None = None,
    agent_url: Literal[""] = "",
    backend: Backend | None = None,
    topology: Topology | None = None,
) -> SandboxPool: ...


@overload
def open_pool(
    template: SandboxTemplate,
    options: PoolOptions | None = None,
    *,
    state_dir: str | Path | None = None,
    agent_url: str,
    backend: None = None,
    topology: None = None,
) -> Pool: ...


def open_pool(
    template: SandboxTemplate,
    options: PoolOptions | None = None,
    *,
    state_dir: str | Path | None = None,
    agent_url: str = "",
    backend: Backend | None = None,
    topology: Topology | None = None,
) -> Pool:
    """The pool factory. The host agent's client when `agent_url` is set (`unix:///path`), else
    an in-process `SandboxPool` (with its own journal in `state_dir`; `backend` and `topology`
    default to the template's backend and this host's). Not started: `await pool.start()`."""
    if agent_url:
        if backend is not None or topology is not None:
            raise ValueError(
                "open_pool: backend and topology are the host agent's, not its client's"
            )
        return AgentPool(agent_url, template, options)
    return SandboxPool(template, options, backend=backend, state_dir=state_dir, topology=topology)


def make_pool(sandbox_cfg: SandboxConfig, agent_url: str = "") -> Pool:
    """`open_pool` for a `[sandbox]` config section; `agent_url` is `rollout.sandbox_agent`."""
    return open_pool(SandboxTemplate.from_config(sandbox_cfg), PoolOptions.from_config(sandbox_cfg),
                     state_dir=sandbox_cfg.state_dir, agent_url=agent_url)  # fmt: skip
