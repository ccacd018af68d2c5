"""The node's host agent (`slipstream sandbox serve`) with real bwrap sandboxes, real processes and
real Unix sockets: admission shared by two worker processes, kill -9 of a worker (its socket
closes: leases end) and of the agent (the restarted agent reaps from the journal), a frozen
worker (lease TTL), a full host ("no capacity"), the socket's permissions, and the proxied
sandbox operations."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import stat
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from slipstream.sandbox import (
    AgentPool,
    AgentUnavailable,
    LeaseExpired,
    NoCapacity,
    SandboxBroken,
    SandboxError,
    SandboxPool,
    SandboxTemplate,
    make_pool,
    open_pool,
)
from slipstream.sandbox.base import reaper_for
from slipstream.sandbox.journal import Journal, process_alive

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not os.access("/usr/bin/bwrap", os.X_OK),
    reason="host agent tests need root (cgroups) and /usr/bin/bwrap",
)
NCPU = len(os.sched_getaffinity(0))
TEMPLATE = SandboxTemplate(backend="bwrap", memory_mib=128, workdir_mib=16)
CLI = [sys.executable, "-c", "import sys; from slipstream.cli import main; sys.exit(main())"]
DEADLINE_S = 60.0  # generous bound for background teardown on a loaded 2-core host


class Agent:
    """A `slipstream sandbox serve` process on tmp paths."""

    def __init__(self, root: Path, *args: str, density: float = 1.0, min_idle: int = 1) -> None:
        self.root = root
        self.socket = root / "run" / "agent.sock"
        self.state = root / "state"
        self.url = f"unix://{self.socket}"
        self.argv = [*CLI, "sandbox", "serve", "--socket", str(self.socket),
                     f"--sandbox.state_dir={self.state}", "--sandbox.backend=bwrap",
                     f"--sandbox.memory_mib={TEMPLATE.memory_mib}",
                     f"--sandbox.workdir_mib={TEMPLATE.workdir_mib}",
                     f"--sandbox.min_idle={min_idle}", "--sandbox.max_idle=2",
                     f"--sandbox.max_density={density}", *args]  # fmt: skip
        self.proc: subprocess.Popen[str] | None = None

    def start(self) -> Agent:
        """Start it and wait until it accepts connections (a crashed one's stale socket does
        not)."""
        self.proc = subprocess.Popen(self.argv, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + DEADLINE_S
        while not self._accepts():
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"agent exited {self.proc.returncode}: {self.proc.stderr.read()}"
                )
            assert time.monotonic() < deadline, "agent did not start serving"
            time.sleep(0.05)
        return self

    def _accepts(self) -> bool:
        probe = socket.socket(socket.AF_UNIX)
        try:
            probe.connect(str(self.socket))
        except (FileNotFoundError, ConnectionRefusedError):
            return False
        finally:
            probe.close()
        return True

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def stop(self) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        rc = self.proc.wait(DEADLINE_S)
        self.proc.stderr.close()
        return rc

    def journal(self) -> dict[str, dict]:
        return {e["sandbox_id"]: e for e in Journal(self.state).entries()}

    def stats(self) -> dict:
        async def ask() -> dict:
            async with AgentPool(self.url, connect_timeout_s=10) as pool:
                return await pool.agent_stats()

        return asyncio.run(ask())


@pytest.fixture
def agents(tmp_path):
    made: list[Agent] = []

    def make(name: str = "a", *args: str, **kw) -> Agent:
        a = Agent(tmp_path / name, *args, **kw)
        made.append(a)
        return a

    yield make
    for a in made:  # whatever a failed test left: stop it, then reap its journal
        if a.proc is not None and a.proc.poll() is None:
            a.proc.kill()
            a.proc.wait()
        if a.state.exists():
            Journal(a.state).reap_orphans(reaper_for)


# A rollout worker stand-in: an AgentPool driven by lines on stdin, answering JSON lines.
WORKER = textwrap.dedent("""
    import asyncio, json, random, sys, time
    from slipstream.sandbox import AgentPool, SandboxTemplate
    url, tmpl = sys.argv[1], SandboxTemplate(**json.loads(sys.argv[2]))

    async def main():
        pool = await AgentPool(url, tmpl, connect_timeout_s=30).start()
        held, spinning = [], []
        loop = asyncio.get_running_loop()
        while line := (await loop.run_in_executor(None, sys.stdin.readline)).split():
            cmd, args = line[0], line[1:]
            out = {}
            if cmd == "acquire":
                for _ in range(int(args[0])):
                    held.append(await pool.acquire(timeout_s=30))
                out["ids"] = [sb.sandbox_id for sb in held]
            elif cmd == "spin":  # a command in flight in every held sandbox
                spinning += [asyncio.ensure_future(sb.exec(["sleep", "600"], timeout_s=900))
                             for sb in held]
                await asyncio.sleep(0.5)
            elif cmd == "exec":
                res = []
                for sb in held:
                    try:
                        r = await sb.exec(["echo", "ok"])
                        res.append(r.stdout.strip())
                    except Exception as e:  # report the error type to the test
                        res.append(type(e).__name__)
                out["results"] = res
            elif cmd == "release":
                for sb in held:
                    await pool.release(sb)
                held = []
            elif cmd == "loop":  # C tasks x M leases: acquire, exec, hold, release; log intervals
                conc, iters = int(args[0]), int(args[1])
                spans = []
                async def one():
                    for _ in range(iters):
                        sb = await pool.acquire(timeout_s=60)
                        t0 = time.monotonic()
                        r = await sb.exec(["echo", "ok"])
                        assert r.stdout == "ok\\n", r
                        await asyncio.sleep(random.uniform(0.2, 0.5))  # a verification
                        spans.append((t0, time.monotonic()))
                        await pool.release(sb)
                await asyncio.gather(*(one() for _ in range(conc)))
                out["spans"] = spans
            print(json.dumps({"ok": cmd, **out}), flush=True)
        await pool.stop()

    asyncio.run(main())
""")


class Worker:
    def __init__(self, agent: Agent) -> None:
        tmpl = json.dumps(TEMPLATE.__dict__)
        self.proc = subprocess.Popen([sys.executable, "-c", WORKER, agent.url, tmpl],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip

    def send(self, line: str) -> None:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def answer(self) -> dict:
        line = self.proc.stdout.readline()
        assert line, f"worker exited {self.proc.poll()}"
        return json.loads(line)

    def ask(self, line: str) -> dict:
        self.send(line)
        return self.answer()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(DEADLINE_S)


def wait_until(cond, what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not cond():
        assert time.monotonic() < deadline, f"not within {DEADLINE_S} s: {what}"
        time.sleep(0.05)


def gone(entries: list[dict]) -> bool:
    """Every recorded process dead and every recorded cgroup removed."""
    return not any(process_alive(e["pid"], e["pid_start_ticks"]) for e in entries) and not any(
        os.path.exists(d) for e in entries for d in e["cgroup_paths"]
    )


def assert_agent_left_nothing(agent: Agent) -> None:
    assert agent.journal() == {}
    assert not agent.socket.exists()
    from slipstream.sandbox.cgroups import CgroupManager

    mine = f"sb-{agent.pid}-"
    assert [d for d in CgroupManager.detect().leftover_dirs() if mine in d] == []


# ---- admission shared by two worker processes ----------------------------------------------------


def test_two_workers_never_exceed_the_agents_admission_limit(agents):
    agent = agents(density=1.5).start()
    limit = int(NCPU * 1.5 + 1e-9)  # sandboxes of 1 vCPU
    live_max = [0]
    stop = threading.Event()

    def sample() -> None:  # live sandboxes on the host: journal entries (idle, leased, dying)
        while not stop.is_set():
            live_max[0] = max(live_max[0], len(list((agent.state / "journal").glob("*.json"))))
            time.sleep(0.005)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    workers = [Worker(agent), Worker(agent)]
    try:
        for w in workers:  # each wants the whole limit at once: twice what the host admits
            w.send(f"loop {limit} 6")
        spans = [w.answer()["spans"] for w in workers]
    finally:
        stop.set()
        sampler.join()
        for w in workers:
            w.close()
    assert all(len(s) == limit * 6 for s in spans)
    events = sorted(
        [(t0, 1) for s in spans for t0, _ in s] + [(t1, -1) for s in spans for _, t1 in s]
    )
    in_flight = peak = 0
    for _, step in events:
        in_flight += step
        peak = max(peak, in_flight)
    stats = agent.stats()
    assert 2 <= peak <= limit, peak  # leases held at once, as the workers saw them
    assert live_max[0] <= limit, live_max[0]  # sandboxes alive at once, as the host saw them
    assert stats["max_in_use"] <= limit and stats["leases_granted"] == 2 * limit * 6
    assert stats["pool"]["vcpu_capacity"] == pytest.approx(limit, abs=0.5)
    assert agent.stop() == 0
    assert_agent_left_nothing(agent)


# ---- kill -9 of a worker, a frozen worker, kill -9 of the agent ----------------------------------


def test_kill_9_of_a_worker_ends_its_leases_and_leaves_nothing(agents):
    agent = agents().start()
    w = Worker(agent)
    ids = w.ask("acquire 2")["ids"]
    w.ask("spin")
    entries = [agent.journal()[i] for i in ids]
    assert all(process_alive(e["pid"], e["pid_start_ticks"]) for e in entries)
    w.proc.send_signal(signal.SIGKILL)
    w.proc.wait()
    wait_until(lambda: not set(ids) & set(agent.journal()) and gone(entries),
               "the dead worker's sandboxes destroyed")  # fmt: skip
    stats = agent.stats()
    assert stats["leases_ended_on_disconnect"] == 2 and stats["in_use"] == 0

    async def normal_operation() -> None:  # the agent carries on for the others
        async with AgentPool(agent.url, TEMPLATE) as pool, pool.sandbox() as sb:
            assert (await sb.exec(["echo", "ok"])).stdout == "ok\n"

    asyncio.run(normal_operation())
    assert agent.stop() == 0
    assert_agent_left_nothing(agent)


def test_a_frozen_worker_loses_its_lease_after_the_ttl(agents):
    agent = agents("a", "--lease-ttl-s", "1.5").start()
    w = Worker(agent)
    (sid,) = w.ask("acquire 1")["ids"]
    entry = agent.journal()[sid]
    w.proc.send_signal(signal.SIGSTOP)  # alive, socket open, no heartbeat
    try:
        wait_until(lambda: sid not in agent.journal() and gone([entry]), "the lease expired")
    finally:
        w.proc.send_signal(signal.SIGCONT)
    assert w.ask("exec")["results"] == [LeaseExpired.__name__]
    w.ask("release")
    assert w.ask("acquire 1") and w.ask("exec")["results"] == ["ok"]  # and it can lease again
    w.ask("release")
    w.close()
    assert agent.stats()["leases_expired"] == 1
    assert agent.stop() == 0
    assert_agent_left_nothing(agent)


def test_kill_9_of_the_agent_restart_reaps_and_workers_lease_again(agents):
    agent = agents().start()
    w = Worker(agent)
    ids = w.ask("acquire 2")["ids"]
    w.ask("spin")
    entries = list(agent.journal().values())  # the two leased ones (and a warm one, if admitted)
    assert set(ids) <= {e["sandbox_id"] for e in entries}
    agent.proc.send_signal(signal.SIGKILL)
    agent.proc.wait()
    assert set(agent.journal()) == {e["sandbox_id"] for e in entries}  # the crash left them
    assert w.ask("exec")["results"] == [AgentUnavailable.__name__] * 2
    w.ask("release")  # of sandboxes that are gone: nothing to do, no error
    agent.start()  # same state dir and socket: reaps the orphans before it serves
    assert not {e["sandbox_id"] for e in entries} & set(agent.journal())
    wait_until(lambda: gone(entries), "the crashed agent's processes and cgroups removed")
    assert w.ask("acquire 1")["ids"] and w.ask("exec")["results"] == ["ok"]  # reconnected
    w.ask("release")
    w.close()
    assert agent.stop() == 0
    assert_agent_left_nothing(agent)


# ---- a full host ----------------------------------------------------------------------------------


def test_a_full_host_answers_no_capacity_and_carries_on(agents):
    agent = agents("a", "--max-waiters", "1", min_idle=0).start()

    async def go() -> None:
        async with AgentPool(agent.url, TEMPLATE) as pool:
            held = [await pool.acquire(timeout_s=30) for _ in range(NCPU)]  # the 1.0x rule
            with pytest.raises(NoCapacity, match=f"host full: .*vcpus={NCPU}/{NCPU}"):
                await pool.acquire(timeout_s=0)
            with pytest.raises(NoCapacity, match="no capacity within 0.3 s"):
                await pool.acquire(timeout_s=0.3)  # the bounded wait passes: still full
            waiter = asyncio.ensure_future(pool.acquire(timeout_s=30))
            while (await pool.agent_stats())["waiting"] == 0:
                await asyncio.sleep(0.02)
            with pytest.raises(NoCapacity, match="already waiting"):
                await pool.acquire(timeout_s=30)  # max_waiters: answered, not queued
            await pool.release(held.pop())
            got = await waiter  # capacity came back within its wait
            assert (await got.exec(["echo", "ok"])).stdout == "ok\n"
            held.append(got)
            stats = await pool.agent_stats()
            assert stats["no_capacity"] == 3 and stats["max_in_use"] == NCPU
            for sb in held:
                await pool.release(sb)
            async with pool.sandbox(timeout_s=30) as sb:  # normal operation afterwards
                assert (await sb.exec(["echo", "ok"])).stdout == "ok\n"

    asyncio.run(go())
    assert issubclass(NoCapacity, SandboxError)  # callers treat it as an infrastructure failure
    assert agent.stop() == 0
    assert_agent_left_nothing(agent)


# ---- proxied operations, refusals, permissions ---------------------------------------------------


def test_proxied_operations_and_refusals(agents, tmp_path):
    agent = agents().start()
    assert stat.S_IMODE(os.stat(agent.socket).st_mode) == 0o660

    async def go() -> None:
        async with AgentPool(agent.url, TEMPLATE) as pool:
            sb = await pool.acquire()
            r = await sb.exec(["sh", "-c", 'cat; echo "$X" > out; cat in.txt; exit 3'], stdin="a\n",
                              files={"in.txt": b"b\n"}, env={"X": "c"})  # fmt: skip
            assert (r.exit_code, r.stdout, r.peak_memory_bytes > 0) == (3, "a\nb\n", True)
            assert await sb.get_file("out") == b"c\n"
            await sb.put_file("sub/f", b"\0\xff" * 1000)
            assert (await sb.exec(["wc", "-c", "sub/f"])).stdout.split()[0] == "2000"
            r = await sb.exec(["sleep", "30"], timeout_s=0.3)
            assert r.timed_out and r.exit_code == -9
            await sb.exec(["mkfifo", "fifo"])
            with pytest.raises(SandboxError, match="regular") as e:  # refused, not waited on
                await sb.get_file("fifo")
            assert not isinstance(e.value, SandboxBroken)
            await sb.reset()
            assert (await sb.exec(["ls"])).stdout == ""
            await pool.release(sb, reuse=True)  # reset and back to the agent's idle set
            pair = [await pool.acquire(), await pool.acquire()]  # the warm one and the reused one
            (again,) = [x for x in pair if x.sandbox_id == sb.sandbox_id]
            assert (await again.exec(["ls"])).stdout == ""
            await pool.release(next(x for x in pair if x is not again))
            with pytest.raises(SandboxBroken):  # the guest agent dies: the lease ends
                await again.exec(["sh", "-c", "kill -9 $PPID; sleep 5"])
            with pytest.raises(SandboxBroken):
                await again.exec(["true"])
            await pool.release(again)  # nothing left to release: no error
            st = pool.stats()
            assert st.acquires == 3 and st.in_use == 0 and st.acquire_wait_p50_s is not None
        with pytest.raises(AgentUnavailable, match="memory_mib: agent 128, client 256"):
            await AgentPool(agent.url, TEMPLATE.with_(memory_mib=256)).start()
        with pytest.raises(AgentUnavailable, match="no host agent at"):
            await AgentPool(f"unix://{tmp_path}/none.sock", connect_timeout_s=0.3).start()

    asyncio.run(go())
    # a second agent on the same state dir, or on a socket another agent serves, is refused
    other = Agent(agent.root, "--socket", str(agent.root / "second.sock"))
    r = subprocess.run(other.argv, capture_output=True, text=True, timeout=DEADLINE_S)
    assert r.returncode == 1 and "another host agent" in r.stderr, r.stderr
    third = Agent(tmp_path / "third")
    third.argv[third.argv.index("--socket") + 1] = str(agent.socket)
    r = subprocess.run(third.argv, capture_output=True, text=True, timeout=DEADLINE_S)
    assert r.returncode == 1 and "another agent is serving" in r.stderr, r.stderr
    Journal(third.state).reap_orphans(reaper_for)
    assert agent.stop() == 0
    assert_agent_left_nothing(agent)


NOBODY_CONNECT = textwrap.dedent("""
    import os, socket, sys
    os.setgroups([]); os.setgid(65534); os.setuid(65534)
    s = socket.socket(socket.AF_UNIX)
    try:
        s.connect(sys.argv[1])
    except PermissionError:
        print("EACCES")
    else:
        print("connected")
""")


def test_who_may_lease_socket_mode_and_uid_allowlist(agents):
    agent = agents("a", "--allow-uid", "4242").start()
    agent.socket.parent.chmod(0o755)  # the directory is not what stops uid 65534 here
    r = subprocess.run([sys.executable, "-c", NOBODY_CONNECT, str(agent.socket)],
                       capture_output=True, text=True, timeout=30)  # fmt: skip
    assert r.stdout.strip() == "EACCES", r  # 0660 root:root: others cannot connect at all

    async def go() -> None:  # root can connect, but is not in the allow-list
        with pytest.raises(AgentUnavailable, match="uid 0 may not lease"):
            await AgentPool(agent.url, TEMPLATE).start()

    asyncio.run(go())
    assert agent.stop() == 0
    assert_agent_left_nothing(agent)


def test_make_pool_picks_the_in_process_pool_or_the_agent(tmp_path):
    from slipstream.config import load_config

    cfg = load_config(None, [f"sandbox.state_dir={tmp_path}"])
    assert type(make_pool(cfg.sandbox, cfg.rollout.sandbox_agent)) is SandboxPool  # the default
    pool = make_pool(cfg.sandbox, "unix:///run/slipstream/sandbox-agent.sock")
    assert isinstance(pool, AgentPool) and pool.socket_path == "/run/slipstream/sandbox-agent.sock"
    assert isinstance(open_pool(TEMPLATE, agent_url="unix:///x.sock"), AgentPool)
    with pytest.raises(ValueError, match="must look like unix:///"):
        open_pool(TEMPLATE, agent_url="tcp://host:1")


def test_hostile_clients_cannot_use_other_leases_or_break_the_agent(agents):
    """Raw frames: a lease id is valid only on the connection it was granted to; malformed
    requests are answered `bad_request` and the session goes on; a frame that is not JSON or is
    too long closes only that connection."""
    import struct

    from slipstream.sandbox.host_protocol import PROTOCOL_VERSION, encode_frame, read_frame

    agent = agents().start()

    async def session() -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        r, w = await asyncio.open_unix_connection(str(agent.socket))
        w.write(encode_frame({"type": "hello", "id": 0, "version": PROTOCOL_VERSION}))
        assert (await read_frame(r))["type"] == "ok"
        return r, w

    async def ask(r, w, msg: dict) -> dict:
        w.write(encode_frame(msg))
        return await read_frame(r)

    async def go() -> None:
        ra, wa = await session()
        lease = (await ask(ra, wa, {"type": "acquire", "id": 1, "wait_s": 30}))["lease"]
        rb, wb = await session()
        stolen = await ask(rb, wb, {"type": "exec", "id": 1, "lease": lease, "argv": ["id"]})
        assert stolen["code"] == "unknown_lease", stolen
        for bad in ({"type": "exec", "id": 2, "lease": lease, "argv": "id"},
                    {"type": "exec", "id": 3, "lease": lease, "argv": ["cat"], "stdin_b64": "!!"},
                    {"type": "exec", "id": 4, "lease": lease, "argv": ["id"], "timeout_s": "inf"},
                    {"type": "acquire", "id": 5, "wait_s": -1},
                    {"type": "frobnicate", "id": 6}):  # fmt: skip
            reply = await ask(ra, wa, bad)
            assert (reply["id"], reply["code"]) == (bad["id"], "bad_request"), reply
        ok = await ask(ra, wa, {"type": "exec", "id": 7, "lease": lease, "argv": ["echo", "ok"]})
        assert ok["result"]["stdout"] == "ok\n"  # the session survived all of that
        wb.write(struct.pack(">I", 12) + b"not json!!!!")
        assert await rb.read() == b""  # closed: that stream cannot be trusted any more
        rc, wc = await session()
        wc.write(struct.pack(">I", 1 << 30))
        assert await rc.read() == b""
        wa.close()  # A leaves: its lease ends, its sandbox is destroyed
        await wa.wait_closed()
        for w in (wb, wc):
            w.close()

    asyncio.run(go())
    wait_until(lambda: agent.stats()["in_use"] == 0, "A's lease ended on disconnect")
    assert agent.stop() == 0
    assert_agent_left_nothing(agent)


def test_sigterm_drains_connected_workers_then_leaves_nothing(agents):
    """SIGTERM: the socket goes at once (no new clients), the connected worker is still served,
    a new lease included (a Spot-draining worker finishes its tasks), and the agent exits when
    that worker has gone, long before its drain timeout."""
    agent = agents("a", "--drain-timeout-s", "600").start()
    w = Worker(agent)
    w.ask("acquire 1")
    agent.proc.send_signal(signal.SIGTERM)
    wait_until(lambda: not agent.socket.exists(), "the socket removed on SIGTERM")
    assert w.ask("acquire 1") and w.ask("exec")["results"] == ["ok", "ok"]
    assert agent.proc.poll() is None  # still serving its connected worker
    w.ask("release")
    w.close()
    assert agent.proc.wait(DEADLINE_S) == 0
    assert_agent_left_nothing(agent)


def test_pinning_and_the_cpus_the_agent_is_given(agents):
    """`--cpus` restricts the agent: its admission limit and its pinning use only those CPUs;
    a leased sandbox runs on the CPUs the agent pinned it to."""
    cpu = sorted(os.sched_getaffinity(0))[-1]
    agent = agents("a", "--cpus", str(cpu), "--sandbox.pinning=thread", min_idle=0).start()
    pinned = TEMPLATE.with_(pinning="thread")

    async def go() -> None:
        async with AgentPool(agent.url, pinned) as pool:
            sb = await pool.acquire(timeout_s=30)
            assert sb.cpus == (cpu,)
            r = await sb.exec(["grep", "Cpus_allowed_list", "/proc/self/status"])
            assert r.stdout.split()[-1] == str(cpu)
            with pytest.raises(NoCapacity, match="vcpus=1/1"):  # one CPU: one sandbox
                await pool.acquire(timeout_s=0)
            await pool.release(sb)

    asyncio.run(go())
    assert agent.stop() == 0
    assert_agent_left_nothing(agent)
