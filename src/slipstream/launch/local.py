"""Local launcher: `rollout.num_workers` rollout worker processes on this machine (the embedded
default, `run.launcher = "local"`).

- The trainer process serves the Coordinator on 127.0.0.1 (launch/worker.py); the address, a
  random authkey and the config go to the workers in a 0600 spec file.
- Each worker is `python -m slipstream.launch.worker --spec FILE --worker-id ID`, its output in
  `<run.output_dir>/launch/logs/<worker id>.log`.
- Supervision (launch/supervise.py): a worker process that exits or is killed is replaced at
  once (like a Spot node group replacing capacity); its leases expire and are redelivered. One
  that keeps failing before it reaches the coordinator is retried with backoff and then fails
  the job with its last output.
- `stop()`: the coordinator's stop flag makes workers drain and exit 0; stragglers get SIGTERM
  after `rollout.drain_timeout_s` + 10 s, then SIGKILL after another `drain_timeout_s` + 5 s.

Not covered: workers on other machines (the Ray launcher places those).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from slipstream.config import SlipstreamConfig
from slipstream.launch.supervise import Ended, RestartPolicy, Supervisor, log_tail
from slipstream.launch.worker import check_sandbox_backend, serve_coordinator

log = logging.getLogger(__name__)


class LocalLauncher:
    """Rollout workers as child processes; see the module docstring."""

    def __init__(self, cfg: SlipstreamConfig, coordinator: Any, *, restart: bool = True) -> None:
        self.cfg = cfg
        self.coord = coordinator
        self.procs: dict[int, subprocess.Popen] = {}
        self.launch_dir = Path(cfg.run.output_dir) / "launch"
        self.spec_path = self.launch_dir / "spec.json"
        self.log_dir = self.launch_dir / "logs"
        self.supervisor = Supervisor(
            coordinator, RestartPolicy.from_config(cfg.rollout), range(cfg.rollout.num_workers),
            spawn=self._spawn, ended=self._ended, restart=restart,
        )  # fmt: skip

    @property
    def num_restarts(self) -> int:
        return self.supervisor.num_restarts

    def start(self) -> None:
        check_sandbox_backend(self.cfg)
        spec = serve_coordinator(self.coord, self.cfg)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.spec_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(spec.to_json(), f)
        self.supervisor.start()

    def _log_path(self, worker_id: str) -> Path:
        return self.log_dir / f"{worker_id}.log"

    def _spawn(self, index: int) -> None:
        wid = self.supervisor.next_worker_id(index)
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        cmd = [sys.executable, "-m", "slipstream.launch.worker", "--spec", str(self.spec_path),
               "--worker-id", wid]  # fmt: skip
        with open(self._log_path(wid), "wb") as logf:  # the child keeps its own descriptor
            self.procs[index] = subprocess.Popen(
                cmd, stdout=logf, stderr=subprocess.STDOUT, env=env
            )

    def _ended(self, index: int) -> Ended | None:
        p = self.procs[index]
        if p.poll() is None:
            return None
        return Ended(p.returncode, log_tail(self._log_path(self.supervisor.worker_id(index))))

    def summary(self) -> dict[str, Any]:
        """What the run's report shows about the workers."""
        return {"worker restarts": self.num_restarts}

    def stop(self) -> dict[int, int | None]:
        """Stop workers (drain via the coordinator, then SIGTERM, then SIGKILL); exit codes."""
        self.supervisor.stop()
        self.coord.request_stop()
        deadline = time.monotonic() + self.cfg.rollout.drain_timeout_s + 10
        with self.supervisor.lock:
            procs = dict(self.procs)
        for p in procs.values():
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.send_signal(signal.SIGTERM)
        for p in procs.values():
            try:
                p.wait(timeout=self.cfg.rollout.drain_timeout_s + 5)
            except subprocess.TimeoutExpired:
                log.warning("rollout worker pid %d ignored SIGTERM; killing", p.pid)
                p.kill()
                p.wait()
        return {i: p.returncode for i, p in procs.items()}
