"""QEMU microVM backend end to end: build the guest image (cached), boot a real microVM (TCG here,
KVM where a test boot proves it works), drive the guest agent over virtio-serial, and check that
release leaves no process, socket, run dir, cgroup or journal entry behind.

One VM serves the module (boot is seconds under TCG); a second one is killed from inside to check
that a dead agent is reported as SandboxBroken and still cleaned up.
"""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path

import pytest

from slipstream.sandbox.base import SandboxTemplate, make_backend
from slipstream.sandbox.errors import SandboxBroken
from slipstream.sandbox.journal import Journal, process_alive

pytestmark = [
    pytest.mark.vm,
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("qemu-system-x86_64") is None, reason="needs qemu-system-x86"),
]

TEMPLATE = SandboxTemplate(
    backend="qemu",
    memory_mib=256,
    create_timeout_s=180,
    exec_timeout_s=60,
    output_cap_bytes=1 << 16,
)


class VM:
    def __init__(self, state_dir: Path) -> None:
        self.loop = asyncio.new_event_loop()
        self.journal = Journal(state_dir)
        self.backend = make_backend("qemu", state_dir=state_dir, journal=self.journal)
        # Pin to the last CPU we may use: checks the cpuset/affinity path at the same time.
        self.cpu = max(os.sched_getaffinity(0))
        self.sb = self.run(
            self.backend.create(TEMPLATE, sandbox_id=f"tq-{os.getpid()}", cpus=(self.cpu,))
        )

    def run(self, coro):
        return self.loop.run_until_complete(coro)


def assert_gone(record) -> None:
    assert not process_alive(record.pid, record.pid_start_ticks), record
    for d in record.cgroup_paths + record.dirs:
        assert not os.path.exists(d), d


@pytest.fixture(scope="module")
def vm(tmp_path_factory):
    v = VM(tmp_path_factory.mktemp("qemu-state"))
    yield v
    record = v.sb.record()
    v.run(v.sb.release())
    assert_gone(record)
    v.loop.close()


def test_python_and_shell(vm):
    r = vm.run(vm.sb.exec(["python3", "-c", "import sys, json; print(1+1, sys.version_info[0])"]))
    assert (r.exit_code, r.stdout, r.timed_out) == (0, "2 3\n", False)
    r = vm.run(vm.sb.exec(["sh", "-c", "echo $((6*7)); echo oops >&2; exit 3"]))
    assert (r.exit_code, r.stdout, r.stderr) == (3, "42\n", "oops\n")
    r = vm.run(
        vm.sb.exec(["python3", "-c", "import sys; print(sys.stdin.read()[::-1])"], stdin="abc")
    )
    assert r.stdout == "cba\n"


def test_guest_is_a_vm_without_host_files(vm):
    r = vm.run(vm.sb.exec(["sh", "-c", "uname -r; test -e /etc/shadow && echo shadow; test -e /work && echo work; ls /sys/class/net"]))  # fmt: skip
    lines = r.stdout.split()
    assert lines[0].endswith("-cloud-amd64")
    assert "shadow" not in lines and "work" not in lines
    assert lines[1:] == ["lo"]  # no network device at all
    assert vm.sb.accel in ("tcg", "kvm") and vm.sb.boot_s > 0


def test_guest_hardening(vm):
    """Inside the VM commands run unprivileged: uid 1000, RLIMIT_NPROC = pids_max, no mount, no
    writes to the image, no view of kernel threads."""
    script = ("id -u; ulimit -u; (echo x > /etc/x) 2>/dev/null || echo ro-etc; "
              "mount -t tmpfs none /tmp 2>/dev/null || echo no-mount; ls /proc | grep -c '^[0-9]'")  # fmt: skip
    out = vm.run(vm.sb.exec(["sh", "-c", script])).stdout.split()
    assert out[:4] == ["1000", str(TEMPLATE.pids_max), "ro-etc", "no-mount"]
    assert int(out[4]) < 10  # the agent, sh, ls, grep: not the guest's kernel threads


def test_files_roundtrip_and_exec_files(vm):
    blob = bytes(range(256)) * 400
    vm.run(vm.sb.put_file("d/blob.bin", blob))
    assert vm.run(vm.sb.get_file("d/blob.bin")) == blob
    r = vm.run(vm.sb.exec(["sh", "-c", "wc -c < d/blob.bin; python3 prog.py"], files={"prog.py": "print('from file')"}))  # fmt: skip
    assert r.stdout.split() == [str(len(blob)), "from", "file"]


def test_timeout_kills_command_and_vm_stays_usable(vm):
    r = vm.run(vm.sb.exec(["sh", "-c", "echo start; sleep 60"], timeout_s=3))
    assert r.timed_out and r.stdout == "start\n"
    r = vm.run(vm.sb.exec(["sh", "-c", "ps -o comm | grep -cx sleep; true"]))
    assert r.stdout == "0\n"


def test_reset_wipes_workdir_and_strays(vm):
    vm.run(vm.sb.put_file("keep.txt", "x"))
    r = vm.run(vm.sb.exec(["sh", "-c", "setsid sleep 300 > /dev/null 2>&1 & echo started"]))
    assert r.stdout == "started\n"
    vm.run(vm.sb.reset())
    r = vm.run(vm.sb.exec(["sh", "-c", "ls -A; ps -o comm | grep -cx sleep; true"]))
    assert r.stdout == "0\n"


def test_pinned_to_requested_cpu(vm):
    status = Path(f"/proc/{vm.sb.vm.proc.pid}/status").read_text()
    allowed = next(
        line.split()[1] for line in status.splitlines() if line.startswith("Cpus_allowed_list")
    )
    assert allowed == str(vm.cpu)
    assert vm.journal.entries() and vm.journal.entries()[0]["sandbox_id"] == vm.sb.sandbox_id


def test_dead_agent_is_broken_and_release_cleans(vm):
    sb = vm.run(vm.backend.create(TEMPLATE, sandbox_id=f"tq-{os.getpid()}-dead"))
    record = sb.record()
    assert os.path.exists(Path(record.dirs[0]) / "ctl.sock")
    with pytest.raises(SandboxBroken):
        vm.run(sb.exec(["sh", "-c", "kill -9 $PPID; sleep 5"]))  # the agent is our parent
    vm.run(sb.release())
    vm.run(sb.release())  # idempotent
    assert_gone(record)
    assert [e["sandbox_id"] for e in vm.journal.entries()] == [vm.sb.sandbox_id]
