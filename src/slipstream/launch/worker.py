"""Rollout worker assembly: what a worker is made of, built from the job's config in whatever
process a launcher placed it (a local process, a Ray actor). Both launchers use this module;
it knows no launcher.

    spec = serve_coordinator(coord, cfg, host)   # trainer process: serve the coordinator
    worker = build_worker(spec, "w0.0")          # worker process: engine, verifier, store, worker
    try:
        rc = worker.run()
    finally:
        close_worker(worker)

- The spec carries the coordinator's address, a random authkey and the resolved config (which
  names the weight store, `store.url`); nothing else travels to a worker.
- The engine: native (the newest published version, loaded here) or a client of an inference
  server (`engine.type = "http"`, waited for up to `engine.server_wait_s`; each worker slot
  stages weights in its own folder under `engine.weights_stage_dir` when that is set).
- The verifier: `make_verifier` (tasks that execute model output verify in a SandboxPool the
  worker owns, stopped by `close_worker`; a SIGKILLed worker's sandboxes die with it and its next
  incarnation's pool reaps their cgroups from the journal).
- `check_sandbox_backend(cfg)`: launchers call it once before placing workers, so a sandbox
  backend that cannot run here fails the job before any worker crash-loops on it.

Worker process entry point: `python -m slipstream.launch.worker --spec FILE --worker-id ID`
(SIGTERM drains the worker: see rl/worker.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import secrets
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slipstream.config import SlipstreamConfig

log = logging.getLogger(__name__)

WEIGHTS_WAIT_S = 120.0  # a starting worker waits this long for the trainer's first publish


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker process is given: where the coordinator is, its key, the job's config."""

    address: tuple[str, int]
    authkey: bytes
    config: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        return {"address": list(self.address), "authkey": self.authkey.hex(),
                "config": self.config}  # fmt: skip

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> WorkerSpec:
        return cls(tuple(data["address"]), bytes.fromhex(data["authkey"]), data["config"])


def serve_coordinator(coord: Any, cfg: SlipstreamConfig, host: str = "127.0.0.1") -> WorkerSpec:
    """Serve the coordinator on host (loopback, or the node's IP under Ray) with a fresh random
    authkey; -> the spec every worker of this job gets."""
    from slipstream.rl.coordinator import serve

    authkey = secrets.token_bytes(16)
    address = serve(coord, authkey, host=host)
    return WorkerSpec(tuple(address), authkey, cfg.model_dump(mode="json"))


def check_sandbox_backend(cfg: SlipstreamConfig) -> None:
    """Fail before any worker starts (and crash-loops) when the workers will verify in a sandbox
    and `sandbox.backend` cannot run here (BackendUnavailable names the reason). Not checked
    when the sandboxes come from the node's host agent (`rollout.sandbox_agent`)."""
    from slipstream.rl.verifier import wants_sandbox
    from slipstream.sandbox import make_backend
    from slipstream.tasks import get_taskset

    if not wants_sandbox(cfg.sandbox.verify_in_sandbox, get_taskset(cfg.task)):
        return
    if cfg.rollout.sandbox_agent:
        return  # the host agent runs the backend; a client that cannot reach it says so
    backend = make_backend(cfg.sandbox.backend, state_dir=cfg.sandbox.state_dir)
    asyncio.run(backend.close())


def build_worker(spec: WorkerSpec, worker_id: str, coord: Any = None) -> Any:
    """A RolloutWorker with its engine and verifier, from the spec (`coord`: the coordinator
    itself, for in-process use; default: a proxy connected to spec.address)."""
    import torch

    from slipstream.rl.coordinator import connect
    from slipstream.rl.verifier import LatencyInjector, make_verifier
    from slipstream.rl.worker import RolloutWorker
    from slipstream.rm.source import make_reward_source
    from slipstream.storage import open_stores
    from slipstream.tasks import get_taskset

    torch.set_num_threads(1)
    cfg = SlipstreamConfig.model_validate(spec.config)
    if coord is None:
        coord = connect(spec.address, spec.authkey)
    weights = open_stores(cfg).weights
    deadline = time.monotonic() + WEIGHTS_WAIT_S
    while (version := weights.latest()) is None:
        if time.monotonic() > deadline:
            raise TimeoutError(f"no weights published in {cfg.store.url} within {WEIGHTS_WAIT_S} s")
        time.sleep(0.1)
    taskset = get_taskset(cfg.task)
    engine = _build_engine(cfg, weights, version, taskset.tokenizer, worker_id)
    try:
        # the sandboxes: leased from the node's host agent (rollout.sandbox_agent), else a
        # private SandboxPool the verifier owns
        verifier: Any = make_verifier(cfg.sandbox, taskset, cfg.rollout.sandbox_agent)
    except BaseException:
        engine.close()
        raise
    try:  # [reward]: the verifier alone, or a reward model over it (rm/source.py)
        verifier = make_reward_source(cfg, verifier)
    except BaseException:
        verifier.close()
        engine.close()
        raise
    rc = cfg.rollout
    if rc.verify_latency == "lognormal":
        verifier = LatencyInjector(verifier, rc.verify_latency_p50_s, rc.verify_latency_p99_over_p50,
                                   seed=hash(worker_id) & 0xFFFF)  # fmt: skip
    try:
        return RolloutWorker(worker_id, coord, engine, taskset, verifier, rc, weights,
                             max_new_tokens=cfg.engine.max_new_tokens, run_seed=cfg.run.seed)  # fmt: skip
    except BaseException:
        verifier.close()
        engine.close()
        raise


def _build_engine(cfg: SlipstreamConfig, weights: Any, version: int, tokenizer: Any,
                  worker_id: str) -> Any:  # fmt: skip
    """The worker's engine. Native: the model at `version`, loaded here. HTTP: a client of the
    server at engine.url, once its /health answers; version -1 (the server holds whatever it
    was started with), so the worker's first weight sync loads the current version into it. The
    server's own config decides what happens to in-flight requests on an update;
    rollout.partial_rollouts applies to the native engine only."""
    import torch

    from slipstream.engine import NativeEngine, build_engine
    from slipstream.model import load_pretrained, model_config_from_hf

    if cfg.engine.type == "http":
        logging.getLogger("httpx").setLevel(logging.WARNING)  # else a log line per request
        stage = cfg.engine.weights_stage_dir
        # One folder per worker slot ("w3" of "w3.1"): workers sharing a server and a stage dir
        # never rewrite or delete a copy the server is reading for another worker.
        slot_dir = str(Path(stage) / worker_id.rsplit(".", 1)[0]) if stage else None
        # the served model's architecture (MoE layers, top-k): decodes routing an SGLang server
        # returns (rollout.record_routing)
        hf_config = weights.fetch_config(version)
        model_cfg = model_config_from_hf(hf_config) if hf_config is not None else None
        engine = build_engine(cfg.engine, version=-1, stage_dir=slot_dir, model_config=model_cfg)
        try:
            engine.wait_ready(cfg.engine.server_wait_s)
        except BaseException:
            engine.close()
            raise
        return engine
    with tempfile.TemporaryDirectory() as tmp:
        model = load_pretrained(
            weights.fetch_to_dir(version, tmp), dtype=getattr(torch, cfg.run.dtype)
        )
    policy = "continue_new" if cfg.rollout.partial_rollouts else "finish_old"
    engine_cfg = cfg.engine.model_copy(update={"weight_update_policy": policy})
    return NativeEngine(model, engine_cfg, tokenizer=tokenizer, version=version)


def close_worker(worker: Any) -> None:
    """Release what build_worker made: the verifier's sandbox pool (every sandbox, cgroup and
    journal entry) and the engine. Call after worker.run() returned (its verifications are done)."""
    try:
        worker.verifier.close()
    finally:
        worker.engine.close()


def worker_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m slipstream.launch.worker")
    p.add_argument("--spec", required=True, help="the launcher's spec file (JSON, mode 0600)")
    p.add_argument("--worker-id", required=True, help='"w<slot>.<generation>"')
    args = p.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s {args.worker_id} %(levelname)s %(message)s"
    )
    spec = WorkerSpec.from_json(json.loads(Path(args.spec).read_text()))
    worker = build_worker(spec, args.worker_id)
    signal.signal(signal.SIGTERM, lambda *_: worker.request_stop())
    try:
        rc = worker.run()
    finally:
        close_worker(worker)
    log.info("exiting %d: %s", rc, worker.stats)
    return rc


if __name__ == "__main__":
    raise SystemExit(worker_main(sys.argv[1:]))
