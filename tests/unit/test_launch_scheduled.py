"""run.launcher = "torchx" on rank 0 (launch/scheduled.py), without TorchX: the launcher serves a
real coordinator where the environment says and starts nothing; a worker that connects with the
job's key is counted, a second incarnation of its slot is a restart; stop() returns once the
workers went quiet. What is missing or inconsistent fails naming the variable or the key."""

from __future__ import annotations

import time

import pytest

from s3util import free_port
from slipstream.config import load_config
from slipstream.launch.base import make_launcher
from slipstream.launch.scheduled import ScheduledLauncher, TorchrunRanks
from slipstream.launch.worker import (
    COORDINATOR_AUTHKEY_ENV,
    COORDINATOR_HOST_ENV,
    COORDINATOR_PORT_ENV,
    worker_main,
)
from slipstream.rl.buffer import ExperienceBuffer
from slipstream.rl.coordinator import Coordinator, connect
from slipstream.rl.queue import TaskQueue


def _coordinator() -> Coordinator:
    return Coordinator(TaskQueue(10), ExperienceBuffer(2, 1))


def test_rank0_serves_the_coordinator_to_workers_the_scheduler_started(monkeypatch) -> None:
    cfg = load_config(None, ["run.launcher=torchx", "rollout.drain_timeout_s=1"])
    port, key = free_port(), "ab" * 16
    monkeypatch.setenv(COORDINATOR_PORT_ENV, str(port))
    monkeypatch.setenv(COORDINATOR_AUTHKEY_ENV, key)
    monkeypatch.setenv(COORDINATOR_HOST_ENV, "127.0.0.1")
    coord = _coordinator()
    launcher = make_launcher(cfg, coord)
    assert isinstance(launcher, ScheduledLauncher)
    launcher.start()
    assert launcher.address == ("127.0.0.1", port)
    proxy = connect(("127.0.0.1", port), bytes.fromhex(key))  # what a rollout pod does
    proxy.report("w3.1000", {"samples": 1.0})
    assert launcher.num_restarts == 0
    proxy.report("w3.2000", {"samples": 2.0})  # the scheduler replaced slot 3's worker
    assert launcher.num_restarts == 1
    assert launcher.summary()["rollout workers seen"] == ["w3.1000", "w3.2000"]
    t0 = time.monotonic()
    assert launcher.stop() == {}
    assert proxy.stopping()  # the workers' signal to drain and exit 0
    assert time.monotonic() - t0 < cfg.rollout.drain_timeout_s + 10


def test_missing_wiring_fails_naming_the_variable(monkeypatch) -> None:
    monkeypatch.delenv(COORDINATOR_PORT_ENV, raising=False)
    cfg = load_config(None, ["run.launcher=torchx"])
    with pytest.raises(RuntimeError, match=COORDINATOR_PORT_ENV):
        make_launcher(cfg, _coordinator()).start()


def test_torchrun_world_must_equal_trainer_num_processes(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "0")
    cfg = load_config(None, ["run.launcher=torchx", "trainer.num_processes=2"])
    with pytest.raises(ValueError, match=r"trainer.num_processes = 2, but torchrun started 4"):
        TorchrunRanks.start(cfg, "unused", tmp_path)


@pytest.mark.parametrize(
    "argv",
    [
        ["--coordinator", "h:1", "-c", "x.toml"],  # no --slot
        ["--coordinator", "h:1", "--slot", "0", "--spec", "s.json"],
        ["--spec", "s.json", "--worker-id", "w0.0", "--run.seed=1"],  # overrides: scheduled only
        ["--coordinator", "h:1", "--slot", "0", "stray"],
    ],
)
def test_worker_entry_refuses_mixed_modes(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as e:
        worker_main(argv)
    assert e.value.code == 2  # argparse's usage error


def test_worker_waits_for_the_coordinators_name_then_gives_up(monkeypatch, tmp_path) -> None:
    """A rollout pod may start before trainer pod 0's service name resolves: it retries, and
    after --coordinator-wait-s fails with the resolver's error."""
    import socket
    import time

    monkeypatch.setenv(COORDINATOR_AUTHKEY_ENV, "ab" * 16)
    (tmp_path / "empty.toml").write_text("")
    t0 = time.monotonic()
    with pytest.raises(socket.gaierror):
        worker_main(["--coordinator", "trainer-0.no-such-job.invalid:29600", "--slot", "0",
                     "-c", str(tmp_path / "empty.toml"), "--coordinator-wait-s", "1.5"])  # fmt: skip
    assert time.monotonic() - t0 >= 1.5


def test_sigterm_while_waiting_for_the_coordinator_exits_0(tmp_path) -> None:
    """A rollout pod terminated (Spot) before its worker started has nothing to drain: exit 0."""
    import os
    import signal
    import subprocess
    import sys
    import time

    (tmp_path / "empty.toml").write_text("")
    env = dict(os.environ, **{COORDINATOR_AUTHKEY_ENV: "ab" * 16})
    cmd = [sys.executable, "-m", "slipstream.launch.worker", "--coordinator",
           f"127.0.0.1:{free_port()}", "--slot", "0", "-c", str(tmp_path / "empty.toml")]  # fmt: skip
    log = tmp_path / "worker.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while "connecting to the coordinator" not in log.read_text():  # its handler is set
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "SIGTERM before the worker started: nothing leased, exiting 0" in log.read_text()


@pytest.mark.parametrize("authkey", ["not-hex-at-all", "abc", "ab" * 8])
def test_a_bad_authkey_is_one_line_naming_the_variable(monkeypatch, tmp_path, authkey) -> None:
    """Issue 44: a non-hex SLIPSTREAM_COORDINATOR_AUTHKEY was a traceback (bytes.fromhex) on
    rank 0 and in every rollout worker; a short one was taken. Now both refuse it, naming the
    variable and never echoing the key."""
    from slipstream.config import ConfigError

    monkeypatch.setenv(COORDINATOR_PORT_ENV, str(free_port()))
    monkeypatch.setenv(COORDINATOR_AUTHKEY_ENV, authkey)
    cfg = load_config(None, ["run.launcher=torchx"])
    with pytest.raises(ConfigError, match=COORDINATOR_AUTHKEY_ENV) as trainer:
        make_launcher(cfg, _coordinator()).start()
    (tmp_path / "empty.toml").write_text("")
    with pytest.raises(SystemExit, match=COORDINATOR_AUTHKEY_ENV) as worker:
        worker_main(["--coordinator", "127.0.0.1:1", "--slot", "0",
                     "-c", str(tmp_path / "empty.toml")])  # fmt: skip
    for e in (trainer.value, worker.value):
        assert authkey not in str(e) and "\n" not in str(e)


def test_rank0_binds_the_coordinator_to_one_address_never_all(monkeypatch) -> None:
    """Issue 44: rank 0 bound 0.0.0.0 wherever SLIPSTREAM_COORDINATOR_HOST was not set (every
    scheduler but Kubernetes). Now: that variable, else TorchX's name for rank 0's host, else
    loopback."""
    from slipstream.launch.scheduled import TORCHX_RANK0_HOST_ENV, coordinator_bind_host

    monkeypatch.delenv(COORDINATOR_HOST_ENV, raising=False)
    monkeypatch.delenv(TORCHX_RANK0_HOST_ENV, raising=False)
    assert coordinator_bind_host() == "127.0.0.1"
    monkeypatch.setenv(TORCHX_RANK0_HOST_ENV, "localhost")  # TorchX's local schedulers
    assert coordinator_bind_host() == "localhost"
    monkeypatch.setenv(COORDINATOR_HOST_ENV, "10.1.2.3")  # Kubernetes: the pod's IP
    assert coordinator_bind_host() == "10.1.2.3"
    monkeypatch.delenv(COORDINATOR_HOST_ENV)
    monkeypatch.delenv(TORCHX_RANK0_HOST_ENV)
    port = free_port()
    monkeypatch.setenv(COORDINATOR_PORT_ENV, str(port))
    monkeypatch.setenv(COORDINATOR_AUTHKEY_ENV, "ab" * 16)
    launcher = make_launcher(load_config(None, ["run.launcher=torchx",
                                                "rollout.drain_timeout_s=1"]), _coordinator())  # fmt: skip
    launcher.start()
    try:
        assert launcher.address == ("127.0.0.1", port)
    finally:
        launcher.stop()
