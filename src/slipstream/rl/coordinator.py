"""Coordinator: the trainer-side service rollout workers talk to (queue + buffer + version), and
its local transport.

Workers call lease / ack / nack / drop / extend / version / stopping / report; the trainer calls
get_batch / set_version / snapshot / restore directly on the object.

Admission control happens in `lease`: a worker gets at most `buffer.admission_slots(version,
in_flight)` tasks, so a lease never asks for work whose samples could only be too stale.

Transport (local launcher): `multiprocessing.managers` over TCP on 127.0.0.1 with a random
authkey. The trainer process serves the one Coordinator object from a background thread
(`serve`); each worker process gets a proxy (`connect`) whose method calls are pickled over the
socket, one connection per calling thread. Exceptions raised in the coordinator are re-raised in
the worker. A worker killed with SIGKILL only drops its connections; its leases expire.

Not covered: authentication beyond the shared authkey, encryption (the Ray launcher binds the
node's IP so other hosts can connect; run it on a private network; never run across real hosts),
a coordinator that outlives the trainer process (the checkpoint carries its state).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from multiprocessing.managers import BaseManager
from typing import Any

from slipstream.rl.buffer import ExperienceBuffer
from slipstream.rl.queue import TaskQueue
from slipstream.rl.types import Batch, Group, Lease, RolloutFailed


@dataclass(frozen=True)
class CoordinatorStatus:
    """One reading of the coordinator (`Coordinator.status`): what the controller logs every step
    (metrics.jsonl) and `/metrics` exports (observe/prometheus.py). Counts are of tasks (the
    queue's) or of groups/samples (the buffer's), as each name says. Picklable: it crosses the
    manager transport."""

    version: int
    """The policy version announced to the workers."""
    queue_pending_tasks: int
    """Redelivered tasks waiting to be leased again."""
    queue_leased_tasks: int
    queue_done_tasks: int
    """Tasks acked or dropped."""
    redelivered_tasks: int
    rejected_acks: int
    """Late or fenced acks."""
    expired_leases: int
    dropped_tasks: int
    """Tasks given up on (`drop`: no group for them)."""
    buffered_groups: int
    """Groups waiting for the trainer."""
    dropped_stale_groups: int
    dropped_uniform_groups: int
    """Groups dropped by dynamic sampling (every reward the same)."""
    wasted_samples: int
    """Samples generated and never trained."""
    staleness_hist: dict[int, int]
    """Staleness in versions -> groups trained at it."""
    buffer: dict[str, Any]
    """All of `ExperienceBuffer.metrics()` (the episode, tool and sandbox numbers no field above
    names; the fields above are read from it)."""

    def other_numbers(self) -> dict[str, float]:
        """The numbers no field names, under the keys the job exports them by
        (`coordinator_status{key}`): "dropped_tasks" and "buffer_<metric>" for the buffer's
        numeric metrics other than the named ones, in the buffer's order."""
        named = {"buffered", "dropped_stale", "dropped_uniform", "wasted_samples"}
        out: dict[str, float] = {"dropped_tasks": self.dropped_tasks}
        for key, v in self.buffer.items():
            if key not in named and isinstance(v, int | float) and not isinstance(v, bool):
                out[f"buffer_{key}"] = v
        return out


class Coordinator:
    def __init__(self, queue: TaskQueue, buffer: ExperienceBuffer) -> None:
        self.queue = queue
        self.buffer = buffer
        queue.set_sink(self._sink)
        buffer.on_stale = lambda groups: queue.requeue([g.task.task_id for g in groups])
        self._lock = threading.Lock()
        self._version = 0
        self._stopping = threading.Event()
        self._arrived = threading.Condition()
        self.worker_stats: dict[str, dict[str, float]] = {}
        self.worker_seen_s: dict[str, float] = {}
        # worker id -> (URL, API key) of its engine's weight endpoint (weight_sync distributed)
        self.engine_urls: dict[str, tuple[str, str | None]] = {}
        self.weight_served: dict[str, dict[str, float]] = {}
        """worker id -> {"version", "seconds"}: the last version pushed to its engine and the
        seconds from the push's start until that engine served it (engine.weight_sync =
        distributed; /metrics exports it)."""
        self.num_acked = 0
        self._failure: str | None = None

    def reached(self, worker_id: str) -> bool:
        """Whether this worker ever leased or reported (it started up)."""
        return worker_id in self.worker_seen_s

    def _sink(self, group: Group) -> None:
        self.buffer.put(group)
        self.num_acked += 1
        with self._arrived:
            self._arrived.notify_all()

    # ---- worker API ----------------------------------------------------------------------------

    def lease(self, worker_id: str, n: int, ttl_s: float) -> Lease | None:
        if self._stopping.is_set():
            return None
        with self._lock:  # admission check and lease together, or two workers share one slot
            self.worker_seen_s[worker_id] = time.time()
            slots = self.buffer.admission_slots(self._version, self.queue.num_in_flight())
            if slots <= 0:
                return None
            return self.queue.lease(worker_id, min(n, slots), ttl_s, policy_version=self._version)

    def ack(self, lease_id: int, group: Group) -> bool:
        return self.queue.ack(lease_id, group)

    def nack(self, lease_id: int, task_ids: list[int] | None = None) -> int:
        return self.queue.nack(lease_id, task_ids)

    def drop(self, lease_id: int, task_ids: list[int], infra_failures: int = 0) -> int:
        """Give up on leased tasks whose episodes kept failing for infrastructure reasons (never
        trained, not redelivered); counted with their failures in the buffer's metrics."""
        n = self.queue.drop(lease_id, task_ids)
        if n:
            self.buffer.count_dropped_infra(n, infra_failures)
        return n

    def extend(self, lease_id: int, ttl_s: float) -> bool:
        return self.queue.extend(lease_id, ttl_s)

    def version(self) -> int:
        return self._version

    def stopping(self) -> bool:
        return self._stopping.is_set()

    def report(self, worker_id: str, stats: dict[str, float]) -> None:
        self.worker_stats[worker_id] = stats
        self.worker_seen_s[worker_id] = time.time()

    def register_engine(self, worker_id: str, url: str, api_key: str | None = None) -> None:
        """engine.weight_sync = distributed: the worker's engine takes weight pushes at `url`
        (with `api_key` as its Bearer key; it travels over this authkey-guarded channel)."""
        with self._lock:
            self.engine_urls[worker_id] = (url, api_key)

    # ---- trainer API ---------------------------------------------------------------------------

    def engines(self) -> dict[str, tuple[str, str | None]]:
        """Worker id -> (weight endpoint URL, API key) of every engine that registered one."""
        with self._lock:
            return dict(self.engine_urls)

    def record_served(self, version: int, seconds: dict[str, float]) -> None:
        """Publish -> served seconds of `version` per worker (see `weight_served`)."""
        for worker, s in seconds.items():
            self.weight_served[worker] = {"version": float(version), "seconds": s}

    def set_version(self, version: int) -> None:
        """Call after the weights of `version` are published (workers fetch them on lease)."""
        with self._lock:
            self._version = version

    def request_stop(self) -> None:
        self._stopping.set()

    def fail(self, reason: str) -> None:
        """The launcher gave up on the rollout workers (e.g. a slot crash-loops): stop the workers
        and make the trainer's next or current get_batch raise RolloutFailed(reason)."""
        self._failure = reason
        self._stopping.set()
        with self._arrived:
            self._arrived.notify_all()

    def get_batch(self, n: int, timeout_s: float, version: int | None = None) -> Batch | None:
        """Wait up to timeout_s for n groups fresh at `version` (the trainer's; default: the
        announced one); None on timeout. Raises RolloutFailed after fail()."""
        deadline = time.monotonic() + timeout_s
        while True:
            if self._failure is not None:
                raise RolloutFailed(self._failure)
            batch = self.buffer.get_batch(n, self._version if version is None else version)
            if batch is not None or time.monotonic() >= deadline:
                return batch
            with self._arrived:
                self._arrived.wait(min(0.05, max(0.0, deadline - time.monotonic())))

    def rollout_backlog(self) -> dict[str, int | None]:
        """Read-only, for autoscaling (observe/prometheus.py): `admission_slots` = tasks
        admission control lets workers lease now, `pending` = redelivered tasks waiting,
        `in_flight` = leased tasks not acked, `unissued` = fresh tasks left (None: endless)."""
        with self._lock:  # the same snapshot lease() decides on
            q = self.queue.stats()
            slots = self.buffer.admission_slots(self._version, q.num_leased)
        issued = q.num_pending + q.num_leased + q.num_done
        max_tasks = self.queue.max_tasks
        return {"admission_slots": slots, "pending": q.num_pending, "in_flight": q.num_leased,
                "unissued": None if max_tasks is None else max(0, max_tasks - issued)}  # fmt: skip

    def status(self) -> CoordinatorStatus:
        q, b = self.queue.stats(), self.buffer.metrics()
        return CoordinatorStatus(
            version=self._version,
            queue_pending_tasks=q.num_pending,
            queue_leased_tasks=q.num_leased,
            queue_done_tasks=q.num_done,
            redelivered_tasks=q.num_redelivered,
            rejected_acks=q.num_rejected_acks,
            expired_leases=q.num_expired_leases,
            dropped_tasks=q.num_dropped,
            buffered_groups=b["buffered"],
            dropped_stale_groups=b["dropped_stale"],
            dropped_uniform_groups=b["dropped_uniform"],
            wasted_samples=b["wasted_samples"],
            staleness_hist={int(k): v for k, v in b["staleness_hist"].items()},
            buffer=b,
        )

    def snapshot(self) -> dict[str, Any]:
        # Under the queue's lock no ack can land between the two snapshots (an ack moves a task
        # to `done` and its group into the buffer in one step).
        with self._lock, self.queue.lock:
            return {"version": self._version, "queue": self.queue.snapshot(),
                    "buffer": self.buffer.snapshot()}  # fmt: skip

    def restore(self, state: dict[str, Any]) -> None:
        with self._lock:
            self._version = state["version"]
            self.queue.restore(state["queue"])
            self.buffer.restore(state["buffer"])


class _Manager(BaseManager):
    pass


def serve(
    coordinator: Coordinator, authkey: bytes, port: int = 0, host: str = "127.0.0.1"
) -> tuple[str, int]:
    """Serve `coordinator` on host (loopback by default) from a daemon thread; returns the
    (host, port). A non-loopback host (the Ray launcher passes the node's IP) makes it reachable
    from other machines, guarded by the authkey only."""

    class M(BaseManager):
        pass

    M.register("coordinator", callable=lambda: coordinator)
    server = M(address=(host, port), authkey=authkey).get_server()
    threading.Thread(target=server.serve_forever, daemon=True, name="coordinator-rpc").start()
    return server.address


def connect(address: tuple[str, int], authkey: bytes, timeout_s: float = 30.0) -> Any:
    """A proxy of the served Coordinator (retries until the server answers)."""
    _Manager.register("coordinator")
    deadline = time.monotonic() + timeout_s
    while True:
        mgr = _Manager(address=tuple(address), authkey=authkey)
        try:
            mgr.connect()
            return mgr.coordinator()
        except (ConnectionRefusedError, FileNotFoundError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
