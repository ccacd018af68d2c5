"""Sandbox protocol pieces that need no sandbox: templates, the backend factory, the seccomp
program's structure, the cgroup interface on a fake cgroup v2 tree, the journal."""

from __future__ import annotations

import os
import struct
import subprocess
import sys

import pytest

from slipstream.config.sandbox import SandboxConfig
from slipstream.sandbox import base
from slipstream.sandbox.base import SandboxTemplate, make_backend
from slipstream.sandbox.cgroups import CgroupLimits, CgroupManager
from slipstream.sandbox.errors import BackendUnavailable
from slipstream.sandbox.journal import Journal, SandboxRecord, process_alive, process_start_ticks
from slipstream.sandbox.seccomp import BLOCKED_X86_64, SECCOMP_RET_ALLOW, build_filter


def test_template_validation_and_config():
    with pytest.raises(ValueError, match="network"):
        SandboxTemplate(network=True)
    with pytest.raises(ValueError, match="'docker'"):
        SandboxTemplate(backend="docker")
    with pytest.raises(ValueError, match="pinning"):
        SandboxTemplate(pinning="socket")
    cfg = SandboxConfig(backend="process", vcpus=2, memory_mib=128, pinning="core")
    t = SandboxTemplate.from_config(cfg)
    assert (t.backend, t.vcpus, t.memory_mib, t.pinning) == ("process", 2, 128, "core")
    assert hash(t) == hash(SandboxTemplate.from_config(cfg))


def test_make_backend_names_and_missing_modules(monkeypatch):
    with pytest.raises(ValueError, match="unknown sandbox backend 'lxc'"):
        make_backend("lxc")
    monkeypatch.setitem(base._LAZY_BACKENDS, "firecracker", ("slipstream.sandbox.nope_fc", "X"))
    with pytest.raises(BackendUnavailable, match="module slipstream.sandbox.nope_fc is missing"):
        make_backend("firecracker")
    b = make_backend("process", state_dir="/tmp/x", journal=None)
    assert b.name == "process" and not b.isolating
    with pytest.raises(TypeError):  # one constructor contract: nothing is silently dropped
        make_backend("process", not_a_param=1)  # type: ignore[call-arg]


def test_seccomp_program_structure():
    prog = build_filter("x86_64")
    assert len(prog) % 8 == 0 and len(prog) // 8 < 4096
    insns = [struct.unpack("=HBBI", prog[i : i + 8]) for i in range(0, len(prog), 8)]
    assert insns[0] == (0x20, 0, 0, 4)  # load arch first
    assert insns[1][3] == 0xC000003E
    compared = {k for code, _, _, k in insns if code == 0x15}
    for name in ("ptrace", "mount", "umount2", "kexec_load", "bpf", "perf_event_open", "unshare",
                 "setns", "keyctl", "add_key"):  # fmt: skip
        assert BLOCKED_X86_64[name] in compared, name
    assert (0x06, 0, 0, SECCOMP_RET_ALLOW) in insns
    # every jump lands inside the program
    for i, (code, jt, jf, _) in enumerate(insns):
        if code & 0x07 == 0x05:
            assert i + 1 + max(jt, jf) < len(insns)
    with pytest.raises(NotImplementedError, match="aarch64"):
        build_filter("aarch64")


def _fake_v2(root):
    root.mkdir()
    (root / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    (root / "cgroup.subtree_control").write_text("")
    (root / "cpuset.cpus.effective").write_text("0-7\n")
    (root / "cpuset.mems.effective").write_text("0\n")


def test_cgroup_v2_on_a_fake_tree(tmp_path):
    root = tmp_path / "cg"
    _fake_v2(root)
    # a real kernel creates these in each new cgroup; the fake tree needs them pre-made
    orig_mkdir = type(root).mkdir

    def mkdir(self, *a, **k):
        orig_mkdir(self, *a, **k)
        for f in ("cgroup.controllers", "cgroup.subtree_control", "cpuset.cpus", "cpu.max"):
            (self / f).write_text("cpuset cpu memory pids\n" if f == "cgroup.controllers" else "")

    type(root).mkdir = mkdir
    try:
        mgr = CgroupManager.detect(root)
        assert mgr.version == 2
        assert "+memory" in (root / "cgroup.subtree_control").read_text()
        cg = mgr.create(
            "sb1", CgroupLimits(memory_bytes=64 << 20, pids_max=32, vcpus=2, cpus=(2, 3))
        )
    finally:
        type(root).mkdir = orig_mkdir
    d = root / "slipstream" / "sb1"
    assert (d / "memory.max").read_text() == str(64 << 20)
    assert (d / "pids.max").read_text() == "32"
    assert (d / "cpuset.cpus").read_text() == "2-3"
    assert (d / "cpuset.mems").read_text() == "0"
    assert (d / "cpu.max").read_text() == "200000 100000"
    (d / "memory.events").write_text("low 0\nhigh 0\nmax 3\noom 1\noom_kill 2\n")
    (d / "memory.peak").write_text("12345\n")
    assert cg.oom_kills() == 2 and cg.peak_memory_bytes() == 12345
    assert cg.dirs == [str(d)]


def test_journal_orphans_only_for_dead_owners(tmp_path):
    j = Journal(tmp_path)
    j.write(SandboxRecord(sandbox_id="mine", backend="bwrap"))
    assert j.orphans() == []  # our own entries are never orphans
    # an entry written by a process that has exited is an orphan; its dir gets removed
    leftover = tmp_path / "left"
    leftover.mkdir()
    code = (
        "import sys; sys.path[:0] = sys.argv[1:2];"
        "from slipstream.sandbox.journal import Journal, SandboxRecord;"
        f"Journal({str(tmp_path)!r}).write(SandboxRecord(sandbox_id='dead', backend='nope', dirs=[{str(leftover)!r}]))"
    )
    subprocess.run(
        [sys.executable, "-c", code, os.path.dirname(base.__file__) + "/../.."], check=True
    )
    orphans = j.orphans()
    assert [o["sandbox_id"] for o in orphans] == ["dead"]
    from slipstream.sandbox.journal import reap_record

    assert j.reap_orphans(lambda name: reap_record) == 1
    assert not leftover.exists()
    assert [e["sandbox_id"] for e in j.entries()] == ["mine"]
    assert process_alive(os.getpid(), process_start_ticks(os.getpid()))
    assert not process_alive(os.getpid(), 1)  # same pid, other start time: a recycled pid
