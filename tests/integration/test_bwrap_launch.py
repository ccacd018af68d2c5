"""The exec chain that starts bwrap (sh -> setpriv -> taskset -> command): the process writes its
own pid into the given cgroup.procs files before anything else runs, ends up as the sandbox uid
with no groups or inheritable capabilities, pinned, with a parent-death signal; a failed write
stops the chain with exit 125 and the shell's message. And a real bwrap sandbox seen from the host:
its bwrap process is in the sandbox's cgroup, as uid 65534, on the pinned CPUs."""

from __future__ import annotations

import asyncio
import os
import subprocess

import pytest

from sandboxutil import needs_bwrap
from slipstream.sandbox.bwrap import SETPRIV, TASKSET, launch_argv

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="the uid drop needs root")
needs_tools = pytest.mark.skipif(
    not all(os.access(x, os.X_OK) for x in (SETPRIV, TASKSET)), reason="needs util-linux"
)


def status_of(text: str) -> dict[str, str]:
    return dict(line.split(":\t", 1) for line in text.splitlines() if ":\t" in line)


@needs_tools
@needs_root
def test_chain_enters_drops_and_pins_before_the_command(tmp_path):
    procs = [tmp_path / "a.procs", tmp_path / "b.procs"]  # stand-ins for v1's per-controller files
    for p in procs:
        p.write_text("")
    cpu = sorted(os.sched_getaffinity(0))[-1]
    argv = launch_argv([str(p) for p in procs], uid=65534, cpus=(cpu,))
    r = subprocess.run(
        [*argv, "cat", "/proc/self/status"], capture_output=True, text=True, timeout=30
    )
    assert r.returncode == 0, r.stderr
    st = status_of(r.stdout)
    pid = st["Pid"].strip()
    assert [p.read_text() for p in procs] == [f"{pid}\n", f"{pid}\n"]  # cat is the same process
    assert st["Uid"].split() == ["65534"] * 4 and st["Gid"].split() == ["65534"] * 4
    assert st["Groups"].strip() == ""
    assert int(st["CapInh"], 16) == 0 and int(st["CapEff"], 16) == 0
    assert st["Cpus_allowed_list"].strip() == str(cpu)


@needs_tools
def test_a_failed_cgroup_write_stops_the_chain(tmp_path):
    argv = launch_argv([str(tmp_path / "missing" / "cgroup.procs")], uid=os.getuid(), cpus=None)
    marker = tmp_path / "ran"
    r = subprocess.run([*argv, "touch", str(marker)], capture_output=True, text=True, timeout=30)
    assert r.returncode == 125 and "cgroup.procs" in r.stderr
    assert not marker.exists()


@needs_tools
@needs_bwrap
def test_a_bwrap_sandbox_seen_from_the_host(tmp_path):
    from slipstream.sandbox.base import SandboxTemplate
    from slipstream.sandbox.bwrap import BwrapBackend

    async def go():
        backend = BwrapBackend(state_dir=tmp_path)
        cpu = sorted(os.sched_getaffinity(0))[0]
        tmpl = SandboxTemplate(backend="bwrap", memory_mib=128, workdir_mib=16)
        sb = await backend.create(tmpl, sandbox_id=f"sb-{os.getpid()}-launch", cpus=(cpu,))
        try:
            pid = sb.proc.pid
            with open(f"/proc/{pid}/status") as f:
                st = status_of(f.read())
            assert st["Name"].strip() == "bwrap"
            assert st["Uid"].split()[0] == "65534" and st["Groups"].strip() == ""
            assert st["Cpus_allowed_list"].strip() == str(cpu)
            for procs in sb.cgroup.procs_files():
                with open(procs) as f:
                    assert str(pid) in f.read().split()
            r = await sb.exec(["sh", "-c", "echo ok"])
            assert r.stdout == "ok\n"
        finally:
            await sb.release()
            await backend.close()

    asyncio.run(go())
