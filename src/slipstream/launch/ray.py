"""Ray launcher: the trainer (this process, the Ray driver) plus N rollout workers as Ray actors.

`run.launcher = "ray"` makes the job driver (launch/job.py) place the workers with `RayLauncher`
instead of `LocalLauncher`; both implement the `Launcher` protocol (launch/base.py) and share the
worker assembly (launch/worker.py) and the supervision policy (launch/supervise.py).

Contract:
- `start()` joins Ray: `run.ray_address` empty starts a private local instance (logical CPUs =
  `rollout.num_workers`, small object store) that `stop()` shuts down again; `auto` or
  `host:port` joins an existing cluster, which `stop()` leaves running. A driver that already
  called `ray.init` is used as it is.
- The Coordinator stays in this process, served by `serve()` on this node's IP
  (`ray.util.get_node_ip_address()`), so actors on any node can connect (authkey only, no TLS).
- Each worker is one actor (`num_cpus=1`, two concurrency slots): `run()` builds a RolloutWorker
  with `build_worker` (launch/worker.py) and runs it in one slot; `request_stop()` reaches it
  through the other.
- Weights: the store URL must be readable from every node. On a cluster of more than one node a
  plain path (the default `<run.output_dir>/store` included) is refused at `start()`; use
  `s3://...` or `file:///...` on a filesystem mounted at the same path on every node.
- Supervision: a thread replaces an actor whose `run()` ended (actor died: RayActorError, e.g. its
  process was killed or its node lost; or run() raised) until the job stops; `num_restarts`
  counts replacements. The replaced worker's leases expire and are redelivered. An actor that
  keeps ending before it reaches the coordinator is retried with backoff and then fails the job
  with its error (the policy of launch/supervise.py, as in the local launcher).
- Node draining (`rollout.drain_file`, for Spot on Kubernetes): when the file appears on an
  actor's node, the actor drains as a worker process does on SIGTERM (stop leasing, finish or
  nack in-flight tasks, return 0) and is replaced. Ray may place the replacement on the same
  node; it then returns NODE_DRAINING before building anything, and the slot is tried again
  every `rollout.restart_backoff_s` (counted in `num_drain_retries`, not as a restart or a start
  failure) until the actor lands on another node or the draining node is gone.
- `stop()`: the coordinator's stop flag makes workers drain and return 0; stragglers get
  `request_stop()` after `rollout.drain_timeout_s` + 10 s, then `ray.kill` after another
  `drain_timeout_s` + 5 s. Codes: run()'s return value, 1 if run() raised, None if the actor died
  or was killed.
- Environment: actors get the driver's `AWS_*` variables (S3 credentials, region) through the
  actor's runtime_env, visible to anyone who can inspect the cluster; nothing else of the
  driver's environment (on an existing cluster actors inherit their raylet's).
- Each started actor is recorded in `<run.output_dir>/launch/ray_workers.jsonl` (index, worker
  id, pid, node IP, node id) once it reports in.

- Reward model (`reward.server = "ray_actor"`): before the rollout actors, one
  `RewardServerActor` (reward.server_resources) loads reward.model and serves POST /classify on
  its node's IP; the workers' reward.url is set to it; it is killed after the workers stop. Not
  restarted if it dies: the workers then requeue every task (never a reward) until the job is
  stopped. Its checkpoint directory must be readable on the actor's node.

Not covered: KubeRay / autoscaling (never run here), several nodes (never run here; only a local
instance was), Ray client (`ray://`) drivers (the coordinator would be served on the client
machine), the sandbox backend check on worker nodes (only the driver's node is checked), GPUs for
actors, queue/buffer as Ray actors.
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

from slipstream.config import SlipstreamConfig
from slipstream.launch.supervise import Ended, RestartPolicy, Supervisor
from slipstream.launch.worker import (
    WorkerSpec,
    build_worker,
    check_sandbox_backend,
    close_worker,
    serve_coordinator,
)

log = logging.getLogger(__name__)

_OBJECT_STORE_BYTES = 100 * 1024 * 1024  # private instance: workers pass no large objects
_FORWARDED_ENV = ("AWS_",)  # environment variables the driver passes on to worker actors
NODE_DRAINING = 75  # run()'s code when rollout.drain_file exists on the node (EX_TEMPFAIL)


def import_ray() -> Any:
    try:
        import ray
    except ImportError as e:
        raise ImportError(
            "run.launcher = 'ray' needs Ray: pip install -e '.[ray]' (the `ray` extra)"
        ) from e
    return ray


def init_ray(cfg: SlipstreamConfig) -> bool:
    """Join Ray per run.ray_address (see the module docstring) unless this process already has;
    -> whether this call started a private local instance (which its caller then shuts down).
    The private instance has a CPU for every rollout worker and every trainer rank but rank 0
    (and the reward model's actor's CPUs, reward.server = "ray_actor")."""
    ray = import_ray()
    if ray.is_initialized():
        return False
    os.environ.setdefault("RAY_DISABLE_USAGE_STATS", "1")
    kwargs: dict[str, Any] = {"ignore_reinit_error": True, "include_dashboard": False}
    if cfg.run.ray_address:
        kwargs["address"] = cfg.run.ray_address
    else:
        cpus = cfg.rollout.num_workers + (cfg.trainer.num_processes - 1)
        if cfg.reward.server == "ray_actor":  # the reward model's own actor
            cpus += math.ceil(cfg.reward.server_resources.get("CPU", 0.0))
        kwargs.update(address="local", num_cpus=cpus, object_store_memory=_OBJECT_STORE_BYTES)
    # ray.init installs its own SIGTERM handler (sys.exit); keep the job's.
    on_main = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGTERM) if on_main else None
    ray.init(**kwargs)
    if previous is not None:
        signal.signal(signal.SIGTERM, previous)
    return not cfg.run.ray_address


def is_local_path(url: str) -> bool:
    """True for a plain filesystem path (no scheme), which other nodes cannot be assumed to see."""
    return "://" not in url


class RolloutActor:
    """One rollout worker inside a Ray actor process (wrapped by `ray.remote` at launch)."""

    def __init__(self, spec: dict[str, Any], worker_id: str) -> None:
        self.spec = WorkerSpec.from_json(spec)
        self.worker_id = worker_id
        self.worker: Any = None
        self._stop = threading.Event()
        logging.basicConfig(
            level=logging.INFO, format=f"%(asctime)s {worker_id} %(levelname)s %(message)s"
        )

    def info(self) -> dict[str, Any]:
        ray = import_ray()
        return {"pid": os.getpid(), "node_ip": ray.util.get_node_ip_address(),
                "node_id": ray.get_runtime_context().get_node_id()}  # fmt: skip

    def run(self) -> int:
        drain_file = self.spec.config["rollout"]["drain_file"]
        if drain_file and os.path.exists(drain_file):
            log.warning("%s exists: this node is draining; not starting", drain_file)
            return NODE_DRAINING
        worker = build_worker(self.spec, self.worker_id)
        self.worker = worker
        if self._stop.is_set():  # stop requested while the worker was being built
            worker.request_stop()
        if drain_file:
            threading.Thread(target=self._watch_drain_file, args=(drain_file,), daemon=True,
                             name="drain-file").start()  # fmt: skip
        try:
            rc = worker.run()
        finally:
            self._stop.set()
            close_worker(worker)
        log.info("exiting %d: %s", rc, worker.stats)
        return rc

    def _watch_drain_file(self, path: str) -> None:
        while not self._stop.wait(0.5):
            if os.path.exists(path):
                log.warning("%s appeared (node reclaimed): draining", path)
                self.worker.request_stop()
                return

    def request_stop(self) -> None:
        self._stop.set()
        if self.worker is not None:
            self.worker.request_stop()


class RewardServerActor:
    """The reward model of reward.server = "ray_actor": POST /classify (rm/server.py) served by
    uvicorn on a thread of this actor, on its node's IP and a free port."""

    def __init__(self, model_dir: str, device: str) -> None:
        import socket

        import uvicorn

        from slipstream.engine.guard import ServeOptions
        from slipstream.model.tokenizer import load_tokenizer
        from slipstream.rm.model import load_reward_model
        from slipstream.rm.server import create_reward_app

        ray = import_ray()
        rm = load_reward_model(model_dir, device=device)
        app = create_reward_app(rm, load_tokenizer(model_dir), ServeOptions(served_model_name="rm"))
        ip = ray.util.get_node_ip_address()
        sock = socket.socket()
        sock.bind((ip, 0))
        self._url = f"http://{ip}:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]},
                                       daemon=True, name="rm-server")  # fmt: skip
        self.thread.start()

    def url(self, timeout_s: float = 120.0) -> str:
        """The base URL once the server accepts connections."""
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"reward model server at {self._url} did not start")
            time.sleep(0.05)
        return self._url


class RayLauncher:
    """Rollout workers as Ray actors; see the module docstring."""

    def __init__(self, cfg: SlipstreamConfig, coordinator: Any, *, restart: bool = True) -> None:
        self.cfg = cfg
        self.coord = coordinator
        self.actors: dict[int, Any] = {}
        self.runs: dict[int, Any] = {}  # index -> ObjectRef of the actor's run()
        self._info: dict[int, Any] = {}  # index -> ObjectRef of info(), until it is recorded
        self._spec: dict[str, Any] = {}
        self._actor_cls: Any = None
        self._started_ray = False
        self._rm_actor: Any = None
        self.reward_url = ""
        self.launch_dir = Path(cfg.run.output_dir) / "launch"
        self.supervisor = Supervisor(
            coordinator, RestartPolicy.from_config(cfg.rollout), range(cfg.rollout.num_workers),
            spawn=self._spawn, ended=self._ended, restart=restart,
            before_poll=self._record_info, name="ray-supervisor",
        )  # fmt: skip

    @property
    def num_restarts(self) -> int:
        return self.supervisor.num_restarts

    @property
    def num_drain_retries(self) -> int:
        """Actors re-placed because their node was draining (not restarts, not start failures)."""
        return self.supervisor.num_drain_retries

    def start(self) -> None:
        ray = import_ray()
        check_sandbox_backend(self.cfg)
        self._init_ray(ray)
        try:
            url = self.cfg.store.url
            nodes = [n for n in ray.nodes() if n.get("Alive")]
            if len(nodes) > 1 and is_local_path(url):
                raise RuntimeError(
                    f"the Ray cluster has {len(nodes)} nodes but the weight store is the local "
                    f"path {url!r}, which workers on other nodes cannot read: set store.url to "
                    "s3://bucket/prefix or to file:///path on a filesystem shared by every node"
                )
            spec = serve_coordinator(self.coord, self.cfg, host=ray.util.get_node_ip_address())
            if self.cfg.reward.server == "ray_actor":  # the workers score at the RM's actor
                url = self._start_reward_server(ray)
                spec.config["reward"].update(url=url, server="none")  # workers only score there
            self._spec = spec.to_json()
            # Actors on a cluster inherit their raylet's environment, not this process's: pass
            # the S3 credentials/region the driver has (a node's IAM role needs none of them).
            env = {k: v for k, v in os.environ.items() if k.startswith(_FORWARDED_ENV)}
            self._actor_cls = ray.remote(num_cpus=1, max_concurrency=2)(RolloutActor).options(
                runtime_env={"env_vars": env} if env else None
            )
            self.launch_dir.mkdir(parents=True, exist_ok=True)
            self.supervisor.start()
        except BaseException:
            self._shutdown_ray(ray)
            raise

    def _start_reward_server(self, ray: Any) -> str:
        """reward.server = "ray_actor": the reward model's own actor; -> its URL."""
        from slipstream.rm.source import reward_model_dir

        res = dict(self.cfg.reward.server_resources)
        cls = ray.remote(num_cpus=res.pop("CPU", 0.0), num_gpus=res.pop("GPU", 0.0),
                         resources=res or None)(RewardServerActor)  # fmt: skip
        device = "cuda" if self.cfg.reward.server_resources.get("GPU", 0) > 0 else "cpu"
        self._rm_actor = cls.remote(str(reward_model_dir(self.cfg).resolve()), device)
        self.reward_url = ray.get(self._rm_actor.url.remote(), timeout=300)
        log.info("reward model served by a Ray actor at %s", self.reward_url)
        return self.reward_url

    def _init_ray(self, ray: Any) -> None:
        self._started_ray = init_ray(self.cfg)

    def _shutdown_ray(self, ray: Any) -> None:
        if self._started_ray:
            ray.shutdown()
            self._started_ray = False

    def _spawn(self, index: int) -> None:
        wid = self.supervisor.next_worker_id(index)
        actor = self._actor_cls.remote(self._spec, wid)
        self.actors[index] = actor
        self.runs[index] = actor.run.remote()
        self._info[index] = actor.info.remote()

    def _ended(self, index: int) -> Ended | None:
        ray = import_ray()
        ref = self.runs[index]
        if not ray.wait([ref], timeout=0)[0]:
            return None
        code, error = self._outcome(ray, ref)
        ray.kill(self.actors[index])  # run() may have raised in a live actor
        return Ended(code, error, draining=code == NODE_DRAINING)

    def _record_info(self) -> None:
        """Append the actors that reported in to launch/ray_workers.jsonl (pid, node)."""
        ray = import_ray()
        for i, ref in list(self._info.items()):
            ready, _ = ray.wait([ref], timeout=0)
            if not ready:
                continue
            del self._info[i]
            try:
                info = ray.get(ref)
            except ray.exceptions.RayError:
                continue  # died before it reported; the run() ref says so too
            entry = {"index": i, "worker_id": self.supervisor.worker_id(i), **info}
            with open(self.launch_dir / "ray_workers.jsonl", "a") as f:
                f.write(json.dumps(entry) + "\n")

    @staticmethod
    def _outcome(ray: Any, ref: Any) -> tuple[int | None, str]:
        """(run()'s return value, ''); (1, the error) if it raised; (None, why) if the actor died."""
        try:
            return int(ray.get(ref)), ""
        except ray.exceptions.RayActorError as e:
            return None, str(e)
        except ray.exceptions.RayTaskError as e:
            log.warning("rollout worker failed: %s", e)
            return 1, str(e)
        except ray.exceptions.RayError as e:  # e.g. the object was lost with its node
            log.warning("rollout worker result lost: %s", e)
            return None, str(e)

    def summary(self) -> dict[str, Any]:
        """What the run's report shows about the workers."""
        out = {"worker restarts": self.num_restarts,
               "worker drain re-placements": self.num_drain_retries}  # fmt: skip
        if self.reward_url:
            out["reward model server (Ray actor)"] = self.reward_url
        return out

    def stop(self) -> dict[int, int | None]:
        """Drain via the coordinator, then request_stop() on stragglers, then ray.kill; codes."""
        ray = import_ray()
        self.supervisor.stop()
        self.coord.request_stop()
        refs = dict(self.runs)
        codes: dict[int, int | None] = {}
        pending = self._wait(ray, refs, codes, self.cfg.rollout.drain_timeout_s + 10)
        for i in pending:
            log.warning("rollout worker actor %d still running after the drain; stopping it", i)
            self.actors[i].request_stop.remote()
        pending = self._wait(ray, pending, codes, self.cfg.rollout.drain_timeout_s + 5)
        for i in pending:
            log.warning("rollout worker actor %d ignored request_stop; killing it", i)
            codes[i] = None
        for actor in self.actors.values():
            ray.kill(actor)
        if self._rm_actor is not None:  # after the workers: they score until they drain
            ray.kill(self._rm_actor)
        self._shutdown_ray(ray)
        return dict(sorted(codes.items()))

    def _wait(
        self, ray: Any, refs: dict[int, Any], codes: dict[int, int | None], timeout_s: float
    ) -> dict[int, Any]:
        """Collect codes of the runs that end within timeout_s; returns the others."""
        deadline = time.monotonic() + timeout_s
        pending = dict(refs)
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            ready, _ = ray.wait(list(pending.values()), num_returns=1, timeout=min(left, 1.0))
            for i, ref in list(pending.items()):
                if ref in ready:
                    codes[i] = self._outcome(ray, ref)[0]
                    del pending[i]
        return pending
