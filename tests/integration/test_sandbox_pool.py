"""SandboxPool with real bwrap sandboxes: refill, admission, pinning, reuse, health checks, orphan
reaping after kill -9 of the pool's process, and a clean stop that leaves nothing behind."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from slipstream.sandbox.base import SandboxTemplate
from slipstream.sandbox.errors import AdmissionTimeout
from slipstream.sandbox.host_topology import parse_cpulist
from slipstream.sandbox.journal import Journal, process_alive, reap_record
from slipstream.sandbox.pool import PoolOptions, SandboxPool

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not os.access("/usr/bin/bwrap", os.X_OK),
    reason="bwrap pool tests need root (cgroups) and /usr/bin/bwrap",
)
NCPU = len(os.sched_getaffinity(0))


def tmpl(**kw) -> SandboxTemplate:
    return SandboxTemplate(**{"backend": "bwrap", "memory_mib": 128, "workdir_mib": 16, **kw})


def assert_clean(pool: SandboxPool) -> None:
    assert pool.journal.entries() == []
    mine = f"sb-{os.getpid()}-"
    assert [d for d in pool.backend.cgroups.leftover_dirs() if mine in d] == []


def test_refill_single_use_and_clean_stop(tmp_path):
    async def go():
        opts = PoolOptions(min_idle=2, max_idle=2, max_density=2.0, create_concurrency=2)
        async with SandboxPool(tmpl(), opts, state_dir=tmp_path) as pool:
            await pool.wait_ready(60)
            assert pool.stats().idle == 2 and pool.stats().created == 2
            sb = await pool.acquire()
            r = await sb.exec(["sh", "-c", "echo hi > f; cat f"])
            assert r.stdout == "hi\n"
            cg = sb.cgroup.dirs
            await pool.release(sb)
            await pool.wait_ready(60)
            st = pool.stats()
            assert st.created == 3 and st.idle == 2  # replaced, not reused
            deadline = time.monotonic() + 60  # destruction runs in the background; a loaded
            while st.destroyed != 1 and time.monotonic() < deadline:  # host is slow at it
                await asyncio.sleep(0.05)
                st = pool.stats()
            assert st.destroyed == 1 and not any(os.path.exists(d) for d in cg)
            assert st.acquires == 1 and st.acquire_wait_p50_s is not None
        assert pool.stats().live == 0
        assert_clean(pool)

    asyncio.run(go())


def test_admission_vcpu_and_memory_limits(tmp_path):
    async def go():
        opts = PoolOptions(min_idle=0, max_idle=0, max_density=1.0)
        async with SandboxPool(tmpl(), opts, state_dir=tmp_path) as pool:
            held = [await pool.acquire(timeout_s=30) for _ in range(NCPU)]  # 1.0x rule: NCPU x 1
            with pytest.raises(AdmissionTimeout, match="vcpus="):
                await pool.acquire(timeout_s=0.3)
            waiter = asyncio.ensure_future(pool.acquire(timeout_s=30))
            await asyncio.sleep(0.1)
            assert not waiter.done()
            await pool.release(held.pop())
            got = await waiter  # admitted once the released sandbox is gone
            held.append(got)
            for sb in held:
                await pool.release(sb)
        assert_clean(pool)
        hungry = PoolOptions(min_idle=0, max_idle=0, memory_reserve_mib=1 << 30)
        async with SandboxPool(tmpl(), hungry, state_dir=tmp_path) as pool:
            with pytest.raises(AdmissionTimeout):
                await pool.acquire(timeout_s=0.2)

    asyncio.run(go())


@pytest.mark.parametrize("policy", ["thread", "core", "l3"])
def test_pinning_sets_affinity_and_cpuset(tmp_path, policy):
    async def go():
        opts = PoolOptions(min_idle=0, max_idle=0)
        async with SandboxPool(tmpl(pinning=policy), opts, state_dir=tmp_path) as pool:
            boxes = [await pool.acquire(timeout_s=30) for _ in range(NCPU)]
            seen = set()
            for sb in boxes:
                assert sb.cpus and set(sb.cpus) <= set(pool.topology.online_cpus)
                r = await sb.exec(
                    ["python3", "-c", "import os; print(sorted(os.sched_getaffinity(0)))"]
                )
                assert json.loads(r.stdout) == sorted(sb.cpus)
                cpuset_dir = str(sb.cgroup.paths["cpuset"])
                cpus = Path(cpuset_dir, "cpuset.cpus").read_text().strip()
                assert parse_cpulist(cpus) == sorted(sb.cpus)
                assert not seen & set(sb.cpus)  # exclusive
                seen |= set(sb.cpus)
            if policy in ("thread", "core"):
                with pytest.raises(AdmissionTimeout):
                    await pool.acquire(timeout_s=0.2)
            for sb in boxes:
                await pool.release(sb)
        assert_clean(pool)

    asyncio.run(go())


def test_reuse_resets_and_health_check_replaces_dead(tmp_path):
    async def go():
        opts = PoolOptions(min_idle=1, max_idle=1, reuse=True, max_density=2.0)
        async with SandboxPool(tmpl(), opts, state_dir=tmp_path) as pool:
            sb = await pool.acquire()
            await sb.exec(["sh", "-c", "echo data > f; sleep 300 &"])
            await pool.release(sb)
            again = await pool.acquire()
            assert again is sb  # reused ...
            assert pool.stats().created == 1  # ... and not replaced behind our back meanwhile
            r = await again.exec(["sh", "-c", "ls; pgrep sleep || echo no-sleep"])
            assert r.stdout == "no-sleep\n"  # ... after a reset: files and strays gone
            await pool.release(again)
            await pool.wait_ready()
            victim = pool._idle[0]
            for pid in victim.cgroup.pids():  # the warm sandbox dies while idle: all of it
                with contextlib.suppress(ProcessLookupError):  # PDEATHSIG may be faster
                    os.kill(pid, signal.SIGKILL)
            await victim.proc.wait()
            while victim.cgroup.pids():
                await asyncio.sleep(0.01)
            fresh = await pool.acquire()
            assert fresh is not victim and pool.stats().health_failures == 1
            assert (await fresh.exec(["true"])).exit_code == 0
            await pool.release(fresh)
        assert_clean(pool)

    asyncio.run(go())


POOL_SCRIPT = """
import asyncio, json, sys
from slipstream.sandbox.base import SandboxTemplate
from slipstream.sandbox.pool import PoolOptions, SandboxPool

async def main():
    pool = SandboxPool(SandboxTemplate(backend="bwrap", memory_mib=128, workdir_mib=16),
                       PoolOptions(min_idle=2, max_idle=2, max_density=2.0), state_dir=sys.argv[1])
    await pool.start()
    await pool.wait_ready(60)
    sb = await pool.acquire()
    await sb.exec(["sh", "-c", "setsid sleep 600 & echo started"])
    await pool.wait_ready(60)  # the refill replaced the acquired one: 2 idle + 1 in use
    recs = [s.record().__dict__ for s in list(pool._idle) + [sb]]
    print(json.dumps(recs), flush=True)
    await asyncio.sleep(600)

asyncio.run(main())
"""


def test_orphans_reaped_after_kill_9(tmp_path):
    try:
        records = _crash_a_pool(tmp_path)
        _check_reaped(tmp_path, records)
    finally:  # even when an assertion failed: leave nothing on the machine
        Journal(tmp_path).reap_orphans(lambda name: reap_record)


def _crash_a_pool(tmp_path) -> list[dict]:
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(POOL_SCRIPT), str(tmp_path)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline()
        assert line, "pool subprocess produced no records"
        records = json.loads(line)
        assert len(records) == 3
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    return records


def _check_reaped(tmp_path, records) -> None:
    journal_dir = tmp_path / "journal"
    assert len(list(journal_dir.glob("*.json"))) == 3  # the crash left its journal behind
    leftover_cgroups = [d for r in records for d in r["cgroup_paths"] if os.path.exists(d)]
    assert leftover_cgroups  # and its cgroups

    async def go():
        async with SandboxPool(
            tmpl(), PoolOptions(min_idle=0, max_idle=0), state_dir=tmp_path
        ) as pool:
            assert pool.stats().orphans_reaped == 3
        assert_clean(pool)

    asyncio.run(go())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(
        process_alive(r["pid"], r["pid_start_ticks"]) for r in records
    ):
        time.sleep(0.05)
    for r in records:
        assert not process_alive(r["pid"], r["pid_start_ticks"])
        assert not any(os.path.exists(d) for d in r["cgroup_paths"])
    assert list(journal_dir.glob("*.json")) == []
