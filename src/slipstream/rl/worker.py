"""RolloutWorker: lease tasks -> generate G samples each with the Engine -> verify -> ack the group.

Contract:
- Holds at most `rollout.max_inflight_tasks` tasks (over several leases), so generation of new
  tasks overlaps verification of earlier ones; every group is acked on its own as soon as it is
  verified (one slow verification delays only its own group).
- The coordinator is the one source of the policy version (it announces a version only after
  its weights are published). Before generating a lease's tasks, the engine is brought to at
  least the lease's `policy_version`; a watcher thread also applies newer versions as the
  coordinator announces them, each loaded from the weight store with `Engine.load_version`
  (the worker never knows how its engine loads weights): with `partial_rollouts` the native
  engine switches mid-generation ("continue_new"; per-token versions record which weights
  produced which token), otherwise in-flight sequences finish on their weights ("finish_old").
- A heartbeat extends live leases every lease_ttl_s / 3. A lease that could not be extended is
  dead (its tasks are redelivered elsewhere): its requests are aborted and nothing of it is acked.
- `request_stop()` (the SIGTERM handler calls it): stop leasing; in-flight work may finish within
  `drain_timeout_s`; then unfinished requests are aborted and their tasks nacked; every completed
  group is acked before `run()` returns 0.

The coordinator may be the object itself or a transport proxy; only its methods are used:
lease, ack, nack, extend, version, stopping, report.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from slipstream.config.rl import RolloutConfig
from slipstream.engine.base import (
    Completion,
    Engine,
    GenerateRequest,
    PublishedWeights,
    SamplingParams,
)
from slipstream.rl import routing
from slipstream.rl.types import Group, Lease, Sample, TaskRef
from slipstream.rl.verifier import Verifier
from slipstream.tasks import TaskSet

log = logging.getLogger(__name__)


@dataclass
class _TaskWork:
    ref: TaskRef
    lease_id: int
    request_id: str = ""
    completions: list[Completion] = field(default_factory=list)
    rewards: list[float | None] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    done: bool = False  # acked, nacked or abandoned


def _routing_fields(c: Completion) -> dict[str, Any]:
    """The completion's recorded routing as Sample fields ({} when not recorded)."""
    if c.routed_experts is None:
        return {}
    data, shape = routing.pack(c.routed_experts)
    return {"routed_experts": data, "routing_shape": shape}


def sample_seed(run_seed: int, task_id: int) -> int:
    """Per-request seed for seeded (deterministic) rollouts; the engine derives per-sample
    streams from it."""
    return (run_seed * 1_000_003 + task_id * 7919 + 17) % (1 << 62)


class RolloutWorker:
    def __init__(
        self,
        worker_id: str,
        coordinator: Any,
        engine: Engine,
        taskset: TaskSet,
        verifier: Verifier,
        cfg: RolloutConfig,
        weights: PublishedWeights,
        *,
        max_new_tokens: int = 32,
        run_seed: int = 0,
    ) -> None:
        """`weights`: the job's weight store; the engine loads the versions the coordinator
        announces from it (`Engine.load_version`, however that engine loads weights)."""
        self.worker_id = worker_id
        self.coord = coordinator
        self.engine = engine
        self.taskset = taskset
        self.verifier = verifier
        self.cfg = cfg
        self.weights = weights
        self.max_new_tokens = cfg.max_new_tokens or max_new_tokens
        self.run_seed = run_seed
        self._stop = threading.Event()
        self._lock = threading.Condition()
        self._tasks: dict[int, _TaskWork] = {}  # task_id -> work
        self._leases: dict[int, set[int]] = {}  # lease_id -> task ids not yet done
        self._weights_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max(1, cfg.verify_threads), thread_name_prefix="verify")
        self.stats: dict[str, float] = {
            "groups_acked": 0, "groups_rejected": 0, "tasks_nacked": 0, "samples": 0,
            "tokens": 0, "weight_updates": 0, "leases": 0, "verify_s": 0.0, "generate_s": 0.0,
        }  # fmt: skip

    # ---- control -------------------------------------------------------------------------------

    def request_stop(self) -> None:
        """Begin draining (safe to call from a signal handler)."""
        self._stop.set()
        with self._lock:
            self._lock.notify_all()

    def _inflight(self) -> int:
        return sum(1 for w in self._tasks.values() if not w.done)

    # ---- weights -------------------------------------------------------------------------------

    def sync_weights(self, min_version: int = -1, timeout_s: float = 120.0) -> None:
        """Bring the engine to the coordinator's current policy version (and at least
        min_version). The coordinator announces a version only after its weights are
        published, so the store holds it unless retention removed it meanwhile; then the
        coordinator is asked again (it has a newer one by then)."""
        deadline = time.monotonic() + timeout_s
        with self._weights_lock:
            while True:
                current = self.coord.version()
                if current > self.engine.version:
                    try:
                        self.engine.load_version(current, self.weights)
                    except FileNotFoundError:  # retention removed it meanwhile: ask again
                        continue
                    self.stats["weight_updates"] += 1
                if self.engine.version >= min_version:
                    return
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"worker {self.worker_id}: engine at weight version {self.engine.version} "
                        f"after {timeout_s} s; version {min_version} needed, coordinator at "
                        f"{current}"
                    )
                time.sleep(0.05)

    def _watch_weights(self) -> None:
        while not self._stop.wait(self.cfg.weight_poll_s):
            self.sync_weights()

    # ---- leases --------------------------------------------------------------------------------

    def _heartbeat(self) -> None:
        period = self.cfg.lease_ttl_s / 3
        last_report = 0.0
        while not self._stop.wait(min(period, 1.0)):
            with self._lock:
                live = list(self._leases)
            for lid in live:
                if not self.coord.extend(lid, self.cfg.lease_ttl_s):
                    self._abandon(lid)
            if time.monotonic() - last_report > 1.0:
                self.coord.report(self.worker_id, dict(self.stats))
                last_report = time.monotonic()

    def _abandon(self, lease_id: int) -> None:
        """The lease is dead: its tasks belong to someone else now."""
        with self._lock:
            tids = self._leases.pop(lease_id, set())
            works = [self._tasks[t] for t in tids if t in self._tasks]
            for w in works:
                w.done = True
            self._lock.notify_all()
        for w in works:
            if w.request_id:
                self.engine.abort(w.request_id)
        log.warning(
            "worker %s: lease %d died; abandoned %d tasks", self.worker_id, lease_id, len(works)
        )

    def _finish(self, w: _TaskWork) -> None:
        with self._lock:
            w.done = True
            rest = self._leases.get(w.lease_id)
            if rest is not None:
                rest.discard(w.ref.task_id)
                if not rest:
                    del self._leases[w.lease_id]
            self._tasks.pop(w.ref.task_id, None)
            self._lock.notify_all()

    # ---- per task ------------------------------------------------------------------------------

    def _start(self, lease: Lease) -> None:
        with self._lock:
            self._leases[lease.lease_id] = {t.task_id for t in lease.tasks}
            for ref in lease.tasks:
                self._tasks[ref.task_id] = _TaskWork(ref, lease.lease_id)
        for ref in lease.tasks:
            task = self.taskset.train(ref.index)
            params = SamplingParams(
                temperature=self.cfg.temperature,
                max_new_tokens=self.max_new_tokens,
                n=self.cfg.group_size,
                seed=sample_seed(self.run_seed, ref.task_id) if self.cfg.seeded else None,
                return_routed_experts=self.cfg.record_routing,
            )
            req = GenerateRequest(self.taskset.prompt_ids(task), params)
            w = self._tasks[ref.task_id]
            w.request_id = req.request_id
            t0 = time.monotonic()
            fut = self.engine.submit(req)
            fut.add_done_callback(lambda f, w=w, task=task, t0=t0: self._generated(w, task, f, t0))

    def _generated(self, w: _TaskWork, task: Any, fut: Future, t0: float) -> None:
        self.stats["generate_s"] += time.monotonic() - t0
        if fut.exception() is not None:
            log.error("worker %s: generation failed for task %d: %s", self.worker_id,
                      w.ref.task_id, fut.exception())  # fmt: skip
            self._nack(w)
            return
        comps: list[Completion] = fut.result()
        if w.done:
            return
        if any(c.finish_reason == "abort" for c in comps):
            self._nack(w)
            return
        w.completions = comps
        w.rewards = [None] * len(comps)
        w.texts = [""] * len(comps)
        for i, c in enumerate(comps):
            self._pool.submit(self._verify_one, w, task, i, c)

    def _verify_one(self, w: _TaskWork, task: Any, i: int, c: Completion) -> None:
        t0 = time.monotonic()
        text = c.text if c.text or not c.token_ids else self.taskset.tokenizer.decode(c.token_ids)
        reward, _reason = self.verifier.verify(task, text)
        self.stats["verify_s"] += time.monotonic() - t0
        with self._lock:
            w.rewards[i] = reward
            w.texts[i] = text
            complete = all(r is not None for r in w.rewards) and not w.done
        if complete:
            self._ack(w)

    def _ack(self, w: _TaskWork) -> None:
        samples = [
            Sample(
                prompt_ids=list(c.prompt_ids),
                completion_ids=list(c.token_ids),
                behaviour_logprobs=list(c.logprobs),
                versions=list(c.versions),
                reward=float(r),
                finish_reason=c.finish_reason,
                text=t,
                **_routing_fields(c),
            )  # fmt: skip
            for c, r, t in zip(w.completions, w.rewards, w.texts, strict=True)
        ]
        group = Group(task=w.ref, samples=samples, worker_id=self.worker_id)
        ok = self.coord.ack(w.lease_id, group)
        self.stats["groups_acked" if ok else "groups_rejected"] += 1
        self.stats["samples"] += len(samples)
        self.stats["tokens"] += sum(len(s.completion_ids) for s in samples)
        self._finish(w)

    def _nack(self, w: _TaskWork) -> None:
        if not w.done:
            self.stats["tasks_nacked"] += self.coord.nack(w.lease_id, [w.ref.task_id])
        self._finish(w)

    # ---- main loop -----------------------------------------------------------------------------

    def run(self) -> int:
        """Work until the coordinator says stop or request_stop(); returns the exit code (0)."""
        self.sync_weights()
        threads = [
            threading.Thread(target=self._heartbeat, daemon=True, name="heartbeat"),
            threading.Thread(target=self._watch_weights, daemon=True, name="weights"),
        ]
        for t in threads:
            t.start()
        self._run_loop()
        self._drain()
        # _drain set the stop flag: the weight thread may still be mid-load; let it finish
        # before the caller closes the engine.
        for t in threads:
            t.join(timeout=max(30.0, self.cfg.drain_timeout_s))
        return 0

    def _run_loop(self) -> None:
        idle_s = 0.005
        while not self._stop.is_set():
            if self.coord.stopping():
                break
            with self._lock:
                room = self.cfg.max_inflight_tasks - self._inflight()
            lease = None
            if room > 0:
                n = min(room, self.cfg.tasks_per_lease)
                lease = self.coord.lease(self.worker_id, n, self.cfg.lease_ttl_s)
            if lease is None:
                with self._lock:
                    self._lock.wait(idle_s)
                idle_s = min(idle_s * 2, 0.05)
                continue
            idle_s = 0.005
            self.stats["leases"] += 1
            self.sync_weights(min_version=lease.policy_version)
            self._start(lease)

    def _drain(self) -> None:
        deadline = time.monotonic() + (self.cfg.drain_timeout_s if self._stop.is_set() else 0.0)
        with self._lock:
            while self._inflight() and time.monotonic() < deadline:
                self._lock.wait(0.05)
            leftovers = [w for w in self._tasks.values() if not w.done]
        for w in leftovers:
            if w.request_id:
                self.engine.abort(w.request_id)
            self._nack(w)
        self._stop.set()
        self._pool.shutdown(wait=True)  # acks of groups mid-verification go out before we return
        try:
            self.coord.report(self.worker_id, dict(self.stats))
        except (ConnectionError, EOFError, OSError):
            pass  # the trainer may already be gone at shutdown
