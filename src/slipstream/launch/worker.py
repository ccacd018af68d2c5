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

Worker process entry points (SIGTERM drains the worker: see rl/worker.py; before the worker is
built it exits 0 at once, nothing being leased yet):

    python -m slipstream.launch.worker --spec FILE --worker-id ID          # local launcher
    python -m slipstream.launch.worker --coordinator HOST:PORT --slot N \
        -c CONFIG [--key=value ...]                                         # a scheduler's role

The second is the rollout role of a scheduled job (launch/scheduled.py, the TorchX component):
the config file and overrides are the trainer's, the authkey comes from
`SLIPSTREAM_COORDINATOR_AUTHKEY` (hex), the worker id is `w<slot>.<start time in ms>` (a replaced
worker is a new incarnation of its slot), and the coordinator is waited for up to
`--coordinator-wait-s` (rank 0 serves it after its SFT warm start).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import secrets
import signal
import socket
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slipstream.config import SlipstreamConfig

log = logging.getLogger(__name__)

WEIGHTS_WAIT_S = 120.0  # a starting worker waits this long for the trainer's first publish
# What wires a scheduled job's roles (launch/scheduled.py); the TorchX component sets them.
COORDINATOR_PORT_ENV = "SLIPSTREAM_COORDINATOR_PORT"
# The address rank 0 binds (launch/scheduled.py `coordinator_bind_host`: the pod's IP on
# Kubernetes; unset elsewhere: the host name TorchX gives rank 0, else 127.0.0.1).
COORDINATOR_HOST_ENV = "SLIPSTREAM_COORDINATOR_HOST"
COORDINATOR_AUTHKEY_ENV = "SLIPSTREAM_COORDINATOR_AUTHKEY"
MIN_AUTHKEY_BYTES = 16  # what the TorchX component makes (32 hex digits)


def authkey_from_env() -> bytes:
    """The coordinator's authkey from `SLIPSTREAM_COORDINATOR_AUTHKEY` (hex, at least
    MIN_AUTHKEY_BYTES bytes). ConfigError naming the variable (never its value) otherwise: the
    key is all that guards the coordinator, whose transport unpickles what it receives."""
    from slipstream.config import ConfigError

    raw = os.environ.get(COORDINATOR_AUTHKEY_ENV, "").strip()
    if not raw:
        raise ConfigError(f"{COORDINATOR_AUTHKEY_ENV} is not set: the coordinator's authkey, "
                          "hex (the TorchX component sets it in every role)")  # fmt: skip
    try:
        key = bytes.fromhex(raw)
    except ValueError:
        raise ConfigError(f"{COORDINATOR_AUTHKEY_ENV} is not hexadecimal ({len(raw)} characters): "
                          "the coordinator's authkey is hex digits, e.g. from "
                          "`python -c 'import secrets; print(secrets.token_hex(16))'`") from None  # fmt: skip
    if len(key) < MIN_AUTHKEY_BYTES:
        raise ConfigError(f"{COORDINATOR_AUTHKEY_ENV} holds {len(key)} bytes; the coordinator's "
                          f"authkey needs at least {MIN_AUTHKEY_BYTES} "
                          f"({2 * MIN_AUTHKEY_BYTES} hex digits)")  # fmt: skip
    return key


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
        worker = RolloutWorker(worker_id, coord, engine, taskset, verifier, rc, weights,
                               max_new_tokens=cfg.engine.max_new_tokens, run_seed=cfg.run.seed,
                               agent=cfg.agent)  # fmt: skip
        if cfg.engine.weight_sync == "distributed":
            # the trainer pushes every version to this engine through SGLang's (or vLLM's)
            # weight-transfer endpoints
            worker.pushed = True
            if cfg.engine.type == "http":
                # an external server: the trainer pushes to it at the URL this worker generates
                # on, with the key this worker sends (it travels over the coordinator's
                # channel); workers sharing the server register the same URL, pushed to once
                coord.register_engine(worker_id, engine.url, engine.api_key)
                return worker
            import secrets

            from slipstream.engine.server import EngineEndpoint

            key = secrets.token_urlsafe(32)  # given to the trainer over the coordinator's channel
            worker.weight_endpoint = EngineEndpoint(engine, taskset.tokenizer, api_key=key,
                                                    timeout_s=cfg.engine.weight_sync_timeout_s)  # fmt: skip
            coord.register_engine(worker_id, worker.weight_endpoint.url, key)
        return worker
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

    from slipstream.engine import build_engine
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
    return build_engine(engine_cfg, model, tokenizer=tokenizer, version=version)


def close_worker(worker: Any) -> None:
    """Release what build_worker made: the verifier's sandbox pool (every sandbox, cgroup and
    journal entry) and the engine. Call after worker.run() returned (its verifications are done)."""
    try:
        worker.verifier.close()
        if worker.weight_endpoint is not None:
            worker.weight_endpoint.close()
    finally:
        worker.engine.close()


def _scheduled_spec(args: argparse.Namespace, overrides: list[str]) -> tuple[WorkerSpec, Any]:
    """The spec of a scheduled role's worker, from the trainer's config and overrides and the
    environment, and a proxy of the coordinator once it answers."""
    from slipstream.config import load_config
    from slipstream.rl.coordinator import connect

    try:
        authkey = authkey_from_env()
    except ValueError as e:  # one line naming the variable, not a traceback
        raise SystemExit(f"--coordinator: {e}") from None
    host, _, port = args.coordinator.rpartition(":")
    if not host or not port.isdigit():
        raise SystemExit(f"--coordinator wants HOST:PORT, got {args.coordinator!r}")
    cfg = load_config(args.config, overrides)
    spec = WorkerSpec((host, int(port)), authkey, cfg.model_dump(mode="json"))
    log.info("connecting to the coordinator at %s (up to %.0f s)", args.coordinator,
             args.coordinator_wait_s)  # fmt: skip
    deadline = time.monotonic() + args.coordinator_wait_s
    # On Kubernetes trainer pod 0's service name resolves only once that pod exists
    while True:
        try:
            socket.getaddrinfo(host, int(port))
            break
        except socket.gaierror:
            if time.monotonic() > deadline:
                raise
            time.sleep(1.0)
    wait_s = max(0.0, deadline - time.monotonic())
    return spec, connect(spec.address, spec.authkey, timeout_s=wait_s)


def _terminated_while_starting(signum: int, frame: Any) -> None:
    log.info("SIGTERM before the worker started: nothing leased, exiting 0")
    raise SystemExit(0)


def worker_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m slipstream.launch.worker", allow_abbrev=False)
    p.add_argument("--spec", help="the launcher's spec file (JSON, mode 0600)")
    p.add_argument("--worker-id", help='"w<slot>.<generation>"')
    p.add_argument("--coordinator", help="HOST:PORT of a scheduled job's coordinator (rank 0)")
    p.add_argument("--slot", type=int, help="with --coordinator: this worker's slot (replica id)")
    p.add_argument("-c", "--config", help="with --coordinator: the job's config file")
    p.add_argument("--coordinator-wait-s", type=float, default=3600.0,
                   help="with --coordinator: how long to wait for it to answer")  # fmt: skip
    args, rest = p.parse_known_args(argv)
    overrides = [a[2:] for a in rest if a.startswith("--") and "=" in a]
    if len(overrides) != len(rest):
        p.error(f"unrecognized arguments (overrides are --key=value): {rest}")
    if not args.coordinator_wait_s > 0:
        p.error(f"--coordinator-wait-s must be > 0, got {args.coordinator_wait_s}")
    if args.coordinator is not None:
        if args.slot is None or args.spec is not None or args.worker_id is not None:
            p.error("--coordinator takes --slot and no --spec/--worker-id")
        worker_id = f"w{args.slot}.{int(time.time() * 1000)}"
    elif args.spec is None or args.worker_id is None or overrides:
        p.error("give --spec and --worker-id, or --coordinator and --slot")
    else:
        worker_id = args.worker_id
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s {worker_id} %(levelname)s %(message)s"
    )
    # SIGTERM while still starting (waiting for the coordinator or the weights, loading): nothing
    # leased yet, so nothing to drain; leave at once with 0, as a drained worker does (a Spot
    # pod terminated during its start is not a failure). build_worker undoes what it built.
    signal.signal(signal.SIGTERM, _terminated_while_starting)
    if args.coordinator is not None:
        spec, coord = _scheduled_spec(args, overrides)
    else:
        spec, coord = WorkerSpec.from_json(json.loads(Path(args.spec).read_text())), None
    worker = build_worker(spec, worker_id, coord)
    signal.signal(signal.SIGTERM, lambda *_: worker.request_stop())
    try:
        rc = worker.run()
    finally:
        close_worker(worker)
    log.info("exiting %d: %s", rc, worker.stats)
    return rc


if __name__ == "__main__":
    raise SystemExit(worker_main(sys.argv[1:]))
