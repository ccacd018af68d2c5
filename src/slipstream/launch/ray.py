"""Ray launcher: the trainer (this process, the Ray driver) plus N rollout workers as Ray actors.

`run.launcher = "ray"` makes `run_local` (launch/local.py) use `RayLauncher` instead of
`LocalLauncher`; the interface is the same: `start()`, `stop() -> {index: code}`, `pids()`,
`num_restarts`.

Contract:
- `start()` joins Ray: `run.ray_address` empty starts a private local instance (logical CPUs =
  `rollout.num_workers`, small object store) that `stop()` shuts down again; `auto` or
  `host:port` joins an existing cluster, which `stop()` leaves running. A driver that already
  called `ray.init` is used as it is.
- The Coordinator stays in this process, served by `serve()` on this node's IP
  (`ray.util.get_node_ip_address()`), so actors on any node can connect (authkey only, no TLS).
- Each worker is one actor (`num_cpus=1`, two concurrency slots): `run()` builds a RolloutWorker
  with `build_worker` and runs it in one slot; `request_stop()` reaches it through the other.
- Weights: the store URL must be readable from every node. On a cluster of more than one node a
  plain path (the default `<run.output_dir>/store` included) is refused at `start()`; use
  `s3://...` or `file:///...` on a filesystem mounted at the same path on every node.
- Supervision: a thread replaces an actor whose `run()` ended (actor died: RayActorError, e.g. its
  process was killed or its node lost; or run() raised) until the job stops; `num_restarts`
  counts replacements. The replaced worker's leases expire and are redelivered. An actor that
  keeps ending before it reaches the coordinator is retried with backoff and then fails the job
  with its error (the policy of launch/restarts.py, as in the local launcher).
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

Not covered: KubeRay / autoscaling (never run here), several nodes (never run here; only a local
instance was), Ray client (`ray://`) drivers (the coordinator would be served on the client
machine), the sandbox backend check on worker nodes (only the driver's node is checked), GPUs for
actors, queue/buffer as Ray actors.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import signal
import threading
import time
from pathlib import Path
from typing import Any

from slipstream.config import SlipstreamConfig
from slipstream.launch.restarts import RestartPolicy, fail_job

log = logging.getLogger(__name__)

_OBJECT_STORE_BYTES = 100 * 1024 * 1024  # private instance: workers pass no large objects
_FORWARDED_ENV = ("AWS_",)  # environment variables the driver passes on to worker actors
NODE_DRAINING = 75  # run()'s code when rollout.drain_file exists on the node (EX_TEMPFAIL)


def _import_ray() -> Any:
    try:
        import ray
    except ImportError as e:
        raise ImportError(
            "run.launcher = 'ray' needs Ray: pip install -e '.[ray]' (the `ray` extra)"
        ) from e
    return ray


def is_local_path(url: str) -> bool:
    """True for a plain filesystem path (no scheme), which other nodes cannot be assumed to see."""
    return "://" not in url


class RolloutActor:
    """One rollout worker inside a Ray actor process (wrapped by `ray.remote` at launch)."""

    def __init__(self, spec: dict[str, Any], worker_id: str) -> None:
        self.spec = spec
        self.worker_id = worker_id
        self.worker: Any = None
        self._stop = threading.Event()
        logging.basicConfig(
            level=logging.INFO, format=f"%(asctime)s {worker_id} %(levelname)s %(message)s"
        )

    def info(self) -> dict[str, Any]:
        ray = _import_ray()
        return {"pid": os.getpid(), "node_ip": ray.util.get_node_ip_address(),
                "node_id": ray.get_runtime_context().get_node_id()}  # fmt: skip

    def run(self) -> int:
        from slipstream.launch.local import build_worker, close_worker

        drain_file = self.spec["config"]["rollout"]["drain_file"]
        if drain_file and os.path.exists(drain_file):
            log.warning("%s exists: this node is draining; not starting", drain_file)
            return NODE_DRAINING
        worker, engine = build_worker(self.spec, self.worker_id)
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
            close_worker(worker, engine)
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


class RayLauncher:
    def __init__(self, cfg: SlipstreamConfig, coordinator: Any, *, restart: bool = True) -> None:
        self.cfg = cfg
        self.coord = coordinator
        self.restart = restart
        self.num_restarts = 0
        self.num_drain_retries = 0  # actors re-placed because their node was draining
        self._drain_retry: set[int] = set()
        self.policy = RestartPolicy.from_config(cfg.rollout)
        self.actors: dict[int, Any] = {}
        self.runs: dict[int, Any] = {}  # index -> ObjectRef of the actor's run()
        self.generation: dict[int, int] = {}
        self._info: dict[int, Any] = {}  # index -> ObjectRef of info(), until it is logged
        self._pids: dict[int, int] = {}
        self._spec: dict[str, Any] = {}
        self._actor_cls: Any = None
        self._started_ray = False
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.launch_dir = Path(cfg.run.output_dir) / "launch"

    def start(self) -> None:
        from slipstream.launch.local import check_sandbox_backend
        from slipstream.rl.controller import store_url
        from slipstream.rl.coordinator import serve

        ray = _import_ray()
        check_sandbox_backend(self.cfg)
        self._init_ray(ray)
        try:
            url = store_url(self.cfg)
            nodes = [n for n in ray.nodes() if n.get("Alive")]
            if len(nodes) > 1 and is_local_path(url):
                raise RuntimeError(
                    f"the Ray cluster has {len(nodes)} nodes but the weight store is the local "
                    f"path {url!r}, which workers on other nodes cannot read: set store.url to "
                    "s3://bucket/prefix or to file:///path on a filesystem shared by every node"
                )
            authkey = secrets.token_bytes(16)
            address = serve(self.coord, authkey, host=ray.util.get_node_ip_address())
            self._spec = {"address": list(address), "authkey": authkey.hex(), "store_url": url,
                          "config": self.cfg.model_dump(mode="json")}  # fmt: skip
            # Actors on a cluster inherit their raylet's environment, not this process's: pass
            # the S3 credentials/region the driver has (a node's IAM role needs none of them).
            env = {k: v for k, v in os.environ.items() if k.startswith(_FORWARDED_ENV)}
            self._actor_cls = ray.remote(num_cpus=1, max_concurrency=2)(RolloutActor).options(
                runtime_env={"env_vars": env} if env else None
            )
            self.launch_dir.mkdir(parents=True, exist_ok=True)
            for i in range(self.cfg.rollout.num_workers):
                self._spawn(i)
        except BaseException:
            self._shutdown_ray(ray)
            raise
        self._thread = threading.Thread(target=self._supervise, daemon=True, name="ray-supervisor")
        self._thread.start()

    def _init_ray(self, ray: Any) -> None:
        if ray.is_initialized():
            return
        os.environ.setdefault("RAY_DISABLE_USAGE_STATS", "1")
        kwargs: dict[str, Any] = {"ignore_reinit_error": True, "include_dashboard": False}
        if self.cfg.run.ray_address:
            kwargs["address"] = self.cfg.run.ray_address
        else:
            kwargs.update(address="local", num_cpus=self.cfg.rollout.num_workers,
                          object_store_memory=_OBJECT_STORE_BYTES)  # fmt: skip
        # ray.init installs its own SIGTERM handler (sys.exit); keep the job's.
        on_main = threading.current_thread() is threading.main_thread()
        previous = signal.getsignal(signal.SIGTERM) if on_main else None
        ray.init(**kwargs)
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        self._started_ray = not self.cfg.run.ray_address

    def _shutdown_ray(self, ray: Any) -> None:
        if self._started_ray:
            ray.shutdown()
            self._started_ray = False

    def _spawn(self, index: int) -> None:
        gen = self.generation.get(index, -1) + 1
        self.generation[index] = gen
        wid = f"w{index}.{gen}"
        actor = self._actor_cls.remote(self._spec, wid)
        self.actors[index] = actor
        self.runs[index] = actor.run.remote()
        self._info[index] = actor.info.remote()

    def _record_info(self, ray: Any) -> None:
        for i, ref in list(self._info.items()):
            ready, _ = ray.wait([ref], timeout=0)
            if not ready:
                continue
            del self._info[i]
            try:
                info = ray.get(ref)
            except ray.exceptions.RayError:
                continue  # died before it reported; the run() ref says so too
            self._pids[i] = info["pid"]
            entry = {"index": i, "worker_id": f"w{i}.{self.generation[i]}", **info}
            with open(self.launch_dir / "ray_workers.jsonl", "a") as f:
                f.write(json.dumps(entry) + "\n")

    def _supervise(self) -> None:
        ray = _import_ray()
        while not self._stopping.wait(0.2):
            with self._lock:
                self._record_info(ray)
                if self._stopping.is_set() or self.coord.stopping() or not self.restart:
                    continue
                now = time.monotonic()
                for i, ref in self.runs.items():
                    if self.policy.waiting(i) or not ray.wait([ref], timeout=0)[0]:
                        continue
                    code, error = self._outcome(ray, ref)
                    ray.kill(self.actors[i])  # run() may have raised in a live actor
                    wid = f"w{i}.{self.generation[i]}"
                    if code == NODE_DRAINING:
                        self.policy.schedule_draining(i, now)
                        self._drain_retry.add(i)
                        continue
                    delay_s = self.policy.schedule(i, self.coord.reached(wid), now)
                    if delay_s is None:
                        fail_job(self.coord, i, wid, code, self.policy.max_start_failures, error)
                        return
                    log.warning("rollout worker actor %d (%s) ended with %s; replacing in %.1f s",
                                i, wid, code, delay_s)  # fmt: skip
                for i in self.policy.due(now):
                    if i in self._drain_retry:
                        self._drain_retry.discard(i)
                        self.num_drain_retries += 1
                    else:
                        self.num_restarts += 1
                    self._spawn(i)

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

    def pids(self) -> list[int]:
        """PIDs (on their nodes) of actors that reported in and whose run() has not ended."""
        ray = _import_ray()
        with self._lock:
            self._record_info(ray)
            return [
                self._pids[i]
                for i, ref in self.runs.items()
                if i in self._pids and not ray.wait([ref], timeout=0)[0]
            ]

    def stop(self) -> dict[int, int | None]:
        """Drain via the coordinator, then request_stop() on stragglers, then ray.kill; codes."""
        ray = _import_ray()
        self._stopping.set()
        if self._thread is not None:
            self._thread.join()
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
