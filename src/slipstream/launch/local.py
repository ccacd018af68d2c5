"""Local launcher: the trainer (this process) plus N rollout worker processes on one machine.

- The trainer process serves the Coordinator over `multiprocessing.managers` on 127.0.0.1 (see
  rl/coordinator.py); the address and a random authkey go to workers in a 0600 file.
- Weights travel through the WeightStore (same URL for everyone): a worker builds its engine from
  the newest published version and follows new ones.
- A supervisor thread restarts a worker process that exits or is killed (like a Spot node group
  replacing capacity) until the run stops; its leases expire and are redelivered. A worker that
  keeps failing before it reaches the coordinator is retried with backoff and then fails the job
  (launch/restarts.py).
- Shutdown: the coordinator's stop flag makes workers drain and exit 0; stragglers get SIGTERM
  after `rollout.drain_timeout_s`, then SIGKILL.
- Verification: each worker verifies with `make_verifier` (rl/verifier.py): tasks that execute
  model output (`code`) go through a SandboxPool the worker owns (`sandbox.verify_in_sandbox`),
  stopped when the worker exits, SIGTERM drain included; a SIGKILLed worker's sandboxes die with it
  (`--die-with-parent`) and its next incarnation's pool reaps their cgroups from the journal. The
  launcher checks once, before spawning workers, that the sandbox backend works here.

Worker processes run `python -m slipstream.launch.local worker --spec FILE --worker-id ID`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from slipstream.config import SlipstreamConfig
from slipstream.launch.restarts import RestartPolicy, fail_job, log_tail

log = logging.getLogger(__name__)


class LocalLauncher:
    def __init__(self, cfg: SlipstreamConfig, coordinator: Any, *, restart: bool = True) -> None:
        self.cfg = cfg
        self.coord = coordinator
        self.restart = restart
        self.procs: dict[int, subprocess.Popen] = {}
        self.generation: dict[int, int] = {}
        self.num_restarts = 0
        self.policy = RestartPolicy.from_config(cfg.rollout)
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self.launch_dir = Path(cfg.run.output_dir) / "launch"
        self.spec_path = self.launch_dir / "spec.json"
        self.log_dir = self.launch_dir / "logs"

    def start(self) -> None:
        from slipstream.rl.controller import store_url
        from slipstream.rl.coordinator import serve

        check_sandbox_backend(self.cfg)
        authkey = secrets.token_bytes(16)
        address = serve(self.coord, authkey)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        spec = {"address": list(address), "authkey": authkey.hex(), "store_url": store_url(self.cfg),
                "config": self.cfg.model_dump(mode="json")}  # fmt: skip
        fd = os.open(self.spec_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(spec, f)
        for i in range(self.cfg.rollout.num_workers):
            self._spawn(i)
        threading.Thread(target=self._supervise, daemon=True, name="supervisor").start()

    def _spawn(self, index: int) -> None:
        gen = self.generation.get(index, -1) + 1
        self.generation[index] = gen
        wid = f"w{index}.{gen}"
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        logf = open(self.log_dir / f"{wid}.log", "wb")  # noqa: SIM115 - owned by the child
        cmd = [sys.executable, "-m", "slipstream.launch.local", "worker", "--spec",
               str(self.spec_path), "--worker-id", wid]  # fmt: skip
        self.procs[index] = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env)
        logf.close()

    def _supervise(self) -> None:
        while not self._stopping.wait(0.2):
            with self._lock:
                if self._stopping.is_set() or self.coord.stopping() or not self.restart:
                    continue
                now = time.monotonic()
                for i, p in self.procs.items():
                    if self.policy.waiting(i) or p.poll() is None:
                        continue
                    wid = f"w{i}.{self.generation[i]}"
                    delay_s = self.policy.schedule(i, self.coord.reached(wid), now)
                    if delay_s is None:
                        fail_job(self.coord, i, wid, p.returncode, self.policy.max_start_failures,
                                 log_tail(self.log_dir / f"{wid}.log"))  # fmt: skip
                        return
                    log.warning("rollout worker %d (%s, pid %d) exited with %s; restarting in %.1f s",
                                i, wid, p.pid, p.returncode, delay_s)  # fmt: skip
                for i in self.policy.due(now):
                    self.num_restarts += 1
                    self._spawn(i)

    def pids(self) -> list[int]:
        with self._lock:
            return [p.pid for p in self.procs.values() if p.poll() is None]

    def stop(self) -> dict[int, int | None]:
        """Stop workers (drain via the coordinator, then SIGTERM, then SIGKILL); exit codes."""
        self._stopping.set()
        self.coord.request_stop()
        grace = self.cfg.rollout.drain_timeout_s + 10
        deadline = time.monotonic() + grace
        with self._lock:
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


def check_sandbox_backend(cfg: SlipstreamConfig) -> None:
    """Fail before any worker starts (and crash-loops) when the workers will verify in a sandbox
    and `sandbox.backend` cannot run here (BackendUnavailable names the reason)."""
    from slipstream.rl.verifier import wants_sandbox
    from slipstream.sandbox import make_backend
    from slipstream.tasks import get_taskset

    if not wants_sandbox(cfg.sandbox.verify_in_sandbox, get_taskset(cfg.task)):
        return
    backend = make_backend(cfg.sandbox.backend, state_dir=cfg.sandbox.state_dir)
    asyncio.run(backend.close())


def start_checkpoint(cfg: SlipstreamConfig, console: Any = None) -> str:
    """The policy the RL run starts from: model.init_from if set, else the SFT checkpoint under
    <run.output_dir>/sft/checkpoint, running the SFT warm start first when it is missing."""
    if cfg.model.init_from:
        return cfg.model.init_from
    from slipstream.sft import checkpoint_complete, run_sft, sft_dir

    ckpt = sft_dir(cfg) / "checkpoint"
    if not checkpoint_complete(ckpt):
        run_sft(cfg, console)
    return str(ckpt)


def run_local(cfg: SlipstreamConfig, console: Any = None, *, display: bool = True) -> Any:
    """The whole job on this machine: warm start if needed, trainer here, workers as processes,
    live display, final report. Returns the controller's RunResult."""
    from rich.console import Console

    from slipstream.observe.progress import RLProgress
    from slipstream.observe.report import write_report
    from slipstream.rl.controller import Controller

    console = console or Console()
    if cfg.run.num_threads:
        import torch

        torch.set_num_threads(cfg.run.num_threads)
    init = start_checkpoint(cfg, console)
    progress = RLProgress(console, plain=None if display else True)
    dp = None
    if cfg.trainer.num_processes > 1:  # data-parallel trainer ranks (launch/dp.py)
        from slipstream.launch.dp import DataParallel

        dp = DataParallel.start(cfg, init, Path(cfg.run.output_dir) / "launch" / "logs")
    try:
        controller = Controller(cfg, init, on_record=progress.update, dp=dp)
    except BaseException:
        if dp is not None:
            dp.close(timeout_s=0)
        raise
    if cfg.run.launcher == "ray":  # workers as Ray actors (launch/ray.py, the `ray` extra)
        from slipstream.launch.ray import RayLauncher

        launcher: LocalLauncher | RayLauncher = RayLauncher(cfg, controller.coord)
    else:
        launcher = LocalLauncher(cfg, controller.coord)

    def on_sigterm(signum: int, frame: Any) -> None:
        # Trainer pod terminated: unwind so `finally` drains and stops the workers. The run
        # resumes from its last checkpoint when started again.
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        launcher.start()
    except BaseException:  # e.g. the sandbox backend check: nothing ran, undo what did
        signal.signal(signal.SIGTERM, previous)
        if dp is not None:
            dp.close(timeout_s=0)
        raise
    try:
        with progress:
            result = controller.run()
    finally:
        codes = launcher.stop()
        signal.signal(signal.SIGTERM, previous)
        if dp is not None:  # after a failure the ranks are blocked in a broadcast: kill them
            dp_codes = dp.close(timeout_s=30 if controller.dp_done else 0)
    summary = {
        "mode": cfg.trainer.mode, "steps": result.steps, "wall_s (RL loop)": result.wall_s,
        "held-out pass@1 before": result.pass_at_1_before, "held-out pass@1 after": result.pass_at_1_after,
        "samples/s": result.samples_per_s, "trainer idle fraction": result.trainer_idle_frac,
        "final batch reward": result.final_reward, "resumed from step": result.resumed_from,
        "worker restarts": launcher.num_restarts, "worker exit codes": codes,
        "buffer": controller.coord.buffer.metrics(),
    }  # fmt: skip
    if cfg.run.launcher == "ray":  # actors re-placed off a draining node (rollout.drain_file)
        summary["worker drain re-placements"] = launcher.num_drain_retries  # type: ignore[union-attr]
    if dp is not None:
        summary["trainer processes (data parallel)"] = cfg.trainer.num_processes
        summary["trainer rank exit codes"] = dp_codes
    report = write_report(cfg.run.output_dir, summary, result.records)
    console.print(f"[bold]report[/] {report} (reward curve: {report.parent / 'reward_curve.png'})")
    return result


# ---- worker process ----------------------------------------------------------------------------


def build_worker(spec: dict[str, Any], worker_id: str, coord: Any = None):
    """Everything a rollout worker process needs, from the launcher's spec."""
    import torch

    from slipstream.rl.controller import storage_options
    from slipstream.rl.coordinator import connect
    from slipstream.rl.verifier import LatencyInjector, close_verifier, make_verifier
    from slipstream.rl.weights import WeightStore
    from slipstream.rl.worker import RolloutWorker
    from slipstream.tasks import get_taskset

    torch.set_num_threads(1)
    cfg = SlipstreamConfig.model_validate(spec["config"])
    if coord is None:
        coord = connect(tuple(spec["address"]), bytes.fromhex(spec["authkey"]))
    store = WeightStore(spec["store_url"], cfg.store.keep_last, storage_options(cfg))
    deadline = time.monotonic() + 120
    while (version := store.latest()) is None:
        if time.monotonic() > deadline:
            raise TimeoutError(f"no weights published in {spec['store_url']} within 120 s")
        time.sleep(0.1)
    taskset = get_taskset(cfg.task)
    engine = _build_engine(cfg, store, version, taskset.tokenizer)
    try:
        verifier: Any = make_verifier(cfg.sandbox, taskset)  # owns a SandboxPool for `code`
    except BaseException:
        engine.close()
        raise
    rc = cfg.rollout
    if rc.verify_latency == "lognormal":
        verifier = LatencyInjector(verifier, rc.verify_latency_p50_s, rc.verify_latency_p99_over_p50,
                                   seed=hash(worker_id) & 0xFFFF)  # fmt: skip
    try:
        worker = RolloutWorker(worker_id, coord, engine, taskset, verifier, rc, weights=store,
                               max_new_tokens=cfg.engine.max_new_tokens, run_seed=cfg.run.seed,
                               weights_stage_dir=cfg.engine.weights_stage_dir)  # fmt: skip
    except BaseException:
        close_verifier(verifier)
        engine.close()
        raise
    return worker, engine


def _build_engine(cfg: SlipstreamConfig, store: Any, version: int, tokenizer: Any) -> Any:
    """The worker's engine. Native: the model at `version`, loaded here. HTTP: a client of the
    server at engine.url, once its /health answers (the worker's first weight sync then loads the
    store's latest version into it; the server's own config decides what happens to in-flight
    requests on an update; rollout.partial_rollouts applies to the native engine only)."""
    import torch

    from slipstream.engine import NativeEngine, build_engine
    from slipstream.model import load_pretrained

    if cfg.engine.type == "http":
        logging.getLogger("httpx").setLevel(logging.WARNING)  # else a log line per request
        # version -1: the server holds whatever it was started with, so the worker's first
        # sync_weights (in run(), retrying if retention removed a version) loads the latest.
        engine = build_engine(cfg.engine, version=-1)
        try:
            engine.wait_ready(cfg.engine.server_wait_s)
        except BaseException:
            engine.close()
            raise
        return engine
    with tempfile.TemporaryDirectory() as tmp:
        model = load_pretrained(
            store.fetch_to_dir(version, tmp), dtype=getattr(torch, cfg.run.dtype)
        )
    policy = "continue_new" if cfg.rollout.partial_rollouts else "finish_old"
    engine_cfg = cfg.engine.model_copy(update={"weight_update_policy": policy})
    return NativeEngine(model, engine_cfg, tokenizer=tokenizer, version=version)


def close_worker(worker: Any, engine: Any) -> None:
    """Release what build_worker made: the verifier's sandbox pool (every sandbox, cgroup and
    journal entry) and the engine. Call after worker.run() returned (its verifications are done)."""
    from slipstream.rl.verifier import close_verifier

    try:
        close_verifier(worker.verifier)
    finally:
        engine.close()


def worker_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="slipstream.launch.local worker")
    p.add_argument("--spec", required=True)
    p.add_argument("--worker-id", required=True)
    args = p.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s {args.worker_id} %(levelname)s %(message)s"
    )
    spec = json.loads(Path(args.spec).read_text())
    worker, engine = build_worker(spec, args.worker_id)
    signal.signal(signal.SIGTERM, lambda *_: worker.request_stop())
    try:
        rc = worker.run()
    finally:
        close_worker(worker, engine)
    log.info("exiting %d: %s", rc, worker.stats)
    return rc


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        raise SystemExit(worker_main(sys.argv[2:]))
    if len(sys.argv) > 2 and sys.argv[1] == "run":  # same as `slipstream run -c FILE [overrides]`
        from slipstream.config import load_config

        logging.basicConfig(level=logging.WARNING)
        run_local(load_config(sys.argv[2], sys.argv[3:]), display=False)
        raise SystemExit(0)
    raise SystemExit(
        "usage: python -m slipstream.launch.local worker --spec FILE --worker-id ID "
        "(the job itself: slipstream run -c FILE)"
    )
