"""`slipstream sandbox run|pool|doctor|reap` end to end through the real entry point."""

from __future__ import annotations

import json
import os

import pytest

from slipstream.cli import main
from slipstream.cli.sandbox import doctor_report
from slipstream.sandbox import base

BWRAP_OK = os.geteuid() == 0 and os.access("/usr/bin/bwrap", os.X_OK)


@pytest.mark.parametrize(
    "backend",
    [
        "process",
        pytest.param("bwrap", marks=pytest.mark.skipif(not BWRAP_OK, reason="needs root + bwrap")),
    ],
)
def test_run_prints_output_and_propagates_exit(backend, capsys, tmp_path):
    state = f"--sandbox.state_dir={tmp_path}"
    assert (
        main(["sandbox", "run", state, "--backend", backend, "--", "python3", "-c", "print(1)"])
        == 0
    )
    out = capsys.readouterr()
    assert out.out == "1\n" and f"[{backend}] exit=0" in out.err
    assert main(["sandbox", "run", state, "--backend", backend, "--", "sh", "-c", "exit 7"]) == 7
    rc = main(
        [
            "sandbox",
            "run",
            state,
            "--backend",
            backend,
            "--timeout",
            "0.5",
            "--json",
            "--",
            "sleep",
            "30",
        ]
    )
    res = json.loads(capsys.readouterr().out)
    assert rc == 137 and res["timed_out"] and res["exit_code"] == -9


def test_pool_command_runs_execs(capsys, tmp_path):
    rc = main(["sandbox", "pool", "--sandbox.backend=process", f"--sandbox.state_dir={tmp_path}",
               "--sandbox.min_idle=1", "--execs", "6", "--concurrency", "2"])  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0 and "6/6" in out and "acquire wait p50" in out
    assert list((tmp_path / "journal").glob("*.json")) == []


def test_doctor_says_why_not(monkeypatch):
    monkeypatch.setitem(base._LAZY_BACKENDS, "qemu", ("slipstream.sandbox.no_such_qemu", "X"))
    monkeypatch.setitem(base._LAZY_BACKENDS, "firecracker", ("slipstream.sandbox.no_such_fc", "X"))
    monkeypatch.setitem(base._LAZY_BACKENDS, "bwrap", ("slipstream.sandbox.bwrap", "BwrapBackend"))
    rows = {r["backend"]: r for r in doctor_report()}
    assert rows["process"]["ok"] and "NOT isolation" in rows["process"]["detail"]
    assert not rows["qemu"]["ok"] and "no_such_qemu is missing" in rows["qemu"]["detail"]
    assert rows["bwrap"]["ok"] == BWRAP_OK
    if BWRAP_OK:
        assert "cgroup v" in rows["bwrap"]["detail"]


def test_reap_command(capsys, tmp_path):
    assert main(["sandbox", "reap", f"--sandbox.state_dir={tmp_path}"]) == 0
    assert "reaped 0 orphaned" in capsys.readouterr().out
