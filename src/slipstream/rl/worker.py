"""RolloutWorker: lease tasks -> run G episodes each (Engine + Environment) -> ack the group.

Every task, single-turn or multi-turn, runs through the one episode loop of
`slipstream.envs.EpisodeRunner`: an environment per episode (keyed by `task.env`; the default
`single_turn` is the task's prompt, one completion and the verifier's reward), the first turn of
a group one engine request with n = G (shared prefill), each later turn the sequence so far as
the prompt. A sample is an episode: its sampled ids exactly as the engine produced them (mask 1,
with their behaviour logprobs and versions), the observations as the environment tokenized them
(mask 0).

Contract:
- Has at most `rollout.max_inflight_tasks` tasks generating (over several leases) and holds at
  most `max_scoring_tasks` more that wait only on their rewards or environment steps
  (`rl.types.rollout_room`), so a slow reward overlaps the generation of newer tasks rather than holding
  a generation slot; every group is acked on its own as soon as it is verified (one slow
  verification delays only its own group).
- The coordinator is the one source of the policy version (it announces a version only after
  its weights are published). Before generating a lease's tasks, the engine is brought to at
  least the lease's `policy_version`; a watcher thread also applies newer versions as the
  coordinator announces them, each loaded from the weight store with `Engine.load_version`
  (the worker never knows how its engine loads weights): with `partial_rollouts` the native
  engine switches mid-generation ("continue_new"; per-token versions record which weights
  produced which token), otherwise in-flight sequences finish on their weights ("finish_old").
  With pushed weights (`engine.weight_sync = "distributed"`, `pushed`) the trainer brings the
  engine to each version; the worker only catches up with the newest stored version when its
  engine serves an older one. An HTTP engine's version is then the one its server reports
  (the pushes bypass the worker), and its samples carry the versions the server tagged.
- A heartbeat extends live leases every lease_ttl_s / 3. A lease that could not be extended is
  dead (its tasks are redelivered elsewhere): its requests are aborted and nothing of it is acked.
- `request_stop()` (the SIGTERM handler calls it): stop leasing; in-flight work may finish within
  `drain_timeout_s`; then unfinished requests are aborted and their tasks nacked; every completed
  group is acked before `run()` returns 0.
- Infrastructure failures are never rewards: an episode whose environment or verifier raised
  `InfraError` is re-run from its start (at most `max_infra_retries` times); after that its task
  is dropped (`Coordinator.drop`, counted) and nothing of it is trained. A reward function that
  gave no reward after its retries (`RewardDropped`) drops the group at once; one that failed
  `reward.max_consecutive_failures` calls in a row stops the job (`Coordinator.fail` with the
  one-line message naming it). Group reward functions run when a group's episodes all finished
  (the runner's `group_scorer` = `verifier.score_group`); per-sample ones as each completion
  finishes, on the verify threads, while other groups generate. A group that failed in
  the engine or was aborted is nacked (its task is redelivered).

The coordinator may be the object itself or a transport proxy; only its methods are used:
lease, ack, nack, extend, version, stopping, report.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from slipstream.config.agent import AgentConfig
from slipstream.config.rl import RolloutConfig
from slipstream.engine.base import Engine, PublishedWeights
from slipstream.envs import (
    Episode,
    EpisodeLimits,
    EpisodeRunner,
    GroupOutcome,
    GroupRollout,
    env_needs_sandbox,
    make_env_factory,
)
from slipstream.envs.agent import AgentRuntime
from slipstream.envs.sandboxes import SandboxHost
from slipstream.rl import routing
from slipstream.rl.types import Group, Lease, Sample, TaskRef, rollout_room
from slipstream.rl.verifier import Verifier
from slipstream.tasks import TaskSet

log = logging.getLogger(__name__)


@dataclass
class _TaskWork:
    ref: TaskRef
    lease_id: int
    rollout: GroupRollout | None = None
    done: bool = False  # acked, nacked, dropped or abandoned


def _routing_fields(ep: Episode) -> dict[str, Any]:
    """The episode's recorded routing as Sample fields ({} when not recorded)."""
    if ep.routed_experts is None:
        return {}
    data, shape = routing.pack(ep.routed_experts)
    return {"routed_experts": data, "routing_shape": shape}


def episode_sample(ep: Episode) -> Sample:
    """The Sample of a finished episode (the mask is stored only when it has observations)."""
    return Sample(
        prompt_ids=ep.prompt_ids, completion_ids=ep.completion_ids,
        behaviour_logprobs=ep.logprobs, versions=ep.versions, reward=float(ep.reward),
        finish_reason=ep.finish_reason, text=ep.text,
        loss_mask=ep.loss_mask if 0 in ep.loss_mask else [], num_turns=ep.num_turns,
        reward_components=dict(ep.reward_components),
        tool_calls=ep.usage.tool_calls, env_s=ep.env_s, tool_s=ep.usage.tool_s,
        sandbox_acquire_s=ep.usage.sandbox_acquire_s, infra_retries=ep.infra_retries,
        episode=ep.episode_index, **_routing_fields(ep),
    )  # fmt: skip


def episode_limits(cfg: RolloutConfig, max_turn_tokens: int) -> EpisodeLimits:
    """The `[rollout]` bounds of every episode."""
    return EpisodeLimits.from_config(cfg, max_turn_tokens)


def _check_sandbox_capacity(sandboxes: SandboxHost, cfg: RolloutConfig) -> int:
    """Every episode in flight holds a sandbox from its reset on, and a group's first turn waits
    for all of its G resets: a pool that cannot hold max_inflight_tasks x group_size sandboxes
    at once would leave groups half-reset, waiting for each other's sandboxes. -> the most tasks
    the worker may hold: max_inflight_tasks + max_scoring_tasks, or fewer when the pool holds
    fewer groups (tasks waiting on their steps keep their sandboxes)."""
    capacity = sandboxes.capacity()
    need = cfg.max_inflight_tasks * cfg.group_size
    if capacity is not None and capacity < need:
        raise ValueError(
            f"the sandbox pool admits {capacity} sandboxes, but rollout.max_inflight_tasks x "
            f"rollout.group_size = {need} episodes hold one each; raise sandbox.max_density "
            f"(or lower those)"
        )
    most = cfg.max_inflight_tasks + cfg.max_scoring_tasks
    return most if capacity is None else min(most, capacity // cfg.group_size)


def _context_tokens(engine: Engine) -> int:
    """The engine's context (prompt + completion) when it is the native engine; 0 = unknown
    (the Engine protocol does not expose it; `rollout.max_episode_tokens` then bounds episodes)."""
    from slipstream.engine.native import NativeEngine

    return engine.max_seq_len if isinstance(engine, NativeEngine) else 0


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
        agent: AgentConfig | None = None,
    ) -> None:
        """`weights`: the job's weight store; the engine loads the versions the coordinator
        announces from it (`Engine.load_version`, however that engine loads weights).
        `agent`: the `[agent]` section, for task.env = "agent" (envs/agent.py)."""
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
        self._live_rollouts = 0  # groups whose on_done has not run yet
        self._weights_lock = threading.Lock()
        self.pushed = False
        """engine.weight_sync = distributed: the trainer pushes every version to the engine
        (the store holds only every N-th; launch/worker.py sets it)."""
        self.weight_endpoint: Any = None
        """engine.weight_sync = distributed, native engine: its HTTP endpoint the trainer pushes
        to (launch/worker.py starts and closes it; an HTTP engine's server is pushed to at
        engine.url)."""
        # environment steps (verification, tool runs) and episode starts run here
        self._pool = ThreadPoolExecutor(max(1, cfg.verify_threads), thread_name_prefix="verify")
        self.sandboxes = verifier.sandboxes
        # only episodes that hold a sandbox from reset need the pool to fit them all; a
        # sandbox-verified single-turn task (code) borrows one per verification and queues
        self._max_held = cfg.max_inflight_tasks + cfg.max_scoring_tasks
        if self.sandboxes is not None and env_needs_sandbox(taskset.cfg.env):
            self._max_held = _check_sandbox_capacity(self.sandboxes, cfg)
        limits = episode_limits(cfg, self.max_new_tokens)
        self.agent: AgentRuntime | None = None
        if taskset.cfg.env == "agent":  # the user's agent drives its episodes (envs/agent.py)
            self.agent = AgentRuntime(engine, taskset, agent or AgentConfig(), limits,
                                      scorer=verifier.verify, temperature=cfg.temperature,
                                      record_routing=cfg.record_routing,
                                      context_tokens=_context_tokens(engine))  # fmt: skip
            make_env = self.agent.factory()
        else:
            make_env = make_env_factory(taskset, scorer=verifier.verify, sandboxes=self.sandboxes,
                                        limits=limits)  # fmt: skip
        self.runner = EpisodeRunner(
            engine, make_env, taskset.tokenizer, episode_limits(cfg, self.max_new_tokens),
            self._pool, temperature=cfg.temperature, record_routing=cfg.record_routing,
            context_tokens=_context_tokens(engine), group_scorer=verifier.score_group,
        )  # fmt: skip
        # `tokens` = sampled tokens; `verify_s` = time in environment steps (the verifier, tool
        # runs); `generate_s` = summed engine request latency (slipstream plan calibrate reads
        # these per group / per sample)
        self.stats: dict[str, float] = {
            "groups_acked": 0, "groups_rejected": 0, "tasks_nacked": 0, "samples": 0,
            "tokens": 0, "weight_updates": 0, "leases": 0, "verify_s": 0.0, "generate_s": 0.0,
            "requests": 0, "turns": 0, "observation_tokens": 0, "tool_calls": 0,
            "tool_s": 0.0, "sandbox_acquires": 0, "sandbox_acquire_s": 0.0,
            "infra_failures": 0, "infra_retried_episodes": 0, "tasks_dropped": 0,
            "prefill_tokens": 0, "reprefill_tokens": 0,
        }  # fmt: skip

    # ---- control -------------------------------------------------------------------------------

    def request_stop(self) -> None:
        """Begin draining (safe to call from a signal handler)."""
        self._stop.set()
        with self._lock:
            self._lock.notify_all()

    def _inflight(self) -> int:
        return sum(1 for w in self._tasks.values() if not w.done)

    def _room(self) -> int:
        """`rollout_room` now (under the lock): a task not yet started counts as generating."""
        held = [w for w in self._tasks.values() if not w.done]
        generating = sum(1 for w in held if w.rollout is None or w.rollout.generating)
        return rollout_room(self.cfg.max_inflight_tasks, self._max_held, generating, len(held))

    def _engine_idle(self) -> None:
        """A group's requests all returned (it now waits on rewards): maybe room for another."""
        with self._lock:
            self._lock.notify_all()

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
                # read once a round: an HTTP engine that is pushed to asks its server
                served = self.engine.version
                if current > served:
                    target = current
                    if self.pushed:
                        # pushed versions: only every N-th is stored; a push this engine
                        # missed is caught up with the newest stored version (the next push
                        # brings the rest)
                        stored = [v for v in self.weights.versions() if v <= current]
                        target = stored[-1] if stored else -1
                    if target > served:
                        try:
                            self.engine.load_version(target, self.weights)
                        except FileNotFoundError:  # retention removed it meanwhile: ask again
                            continue
                        except RuntimeError:
                            # a push overtook this catch-up (a server refuses a version below
                            # the one it serves): what it serves now decides
                            if not self.pushed or self.engine.version < target:
                                raise
                            continue
                        self.stats["weight_updates"] += 1
                    served = self.engine.version
                if served >= min_version:
                    return
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"worker {self.worker_id}: engine at weight version {served} "
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
                self.coord.report(self.worker_id, self.report())
                last_report = time.monotonic()

    def report(self) -> dict[str, float]:
        """What the worker reports to the coordinator every second: its counters, the weight
        version its engine serves (`weight_version`), and its sandbox pool's numbers
        (`sandbox_pool_<field>`, when it has one): the job's /metrics exports them per worker."""
        out = dict(self.stats)
        out.update(self.verifier.reward_stats())
        out["weight_version"] = float(self.engine.version)
        if self.agent is not None:
            out.update({f"agent_{k}": v for k, v in self.agent.stats.as_dict().items()})
        pool = self.sandboxes.stats() if self.sandboxes is not None else None
        if pool is not None:
            for key, value in vars(pool).items():
                if isinstance(value, int | float) and not isinstance(value, bool):
                    out[f"sandbox_pool_{key}"] = float(value)
        return out

    def _abandon(self, lease_id: int) -> None:
        """The lease is dead: its tasks belong to someone else now."""
        with self._lock:
            tids = self._leases.pop(lease_id, set())
            works = [self._tasks[t] for t in tids if t in self._tasks]
            for w in works:
                w.done = True
            self._lock.notify_all()
        for w in works:
            if w.rollout is not None:
                w.rollout.abort()
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
            if self._tasks.get(w.ref.task_id) is w:  # a redelivery may have replaced it
                del self._tasks[w.ref.task_id]
            self._lock.notify_all()

    # ---- per task ------------------------------------------------------------------------------

    def _start(self, lease: Lease) -> None:
        with self._lock:
            self._leases[lease.lease_id] = {t.task_id for t in lease.tasks}
            for ref in lease.tasks:
                self._tasks[ref.task_id] = _TaskWork(ref, lease.lease_id)
        for ref in lease.tasks:
            task = self.taskset.train(ref.index)
            w = self._tasks[ref.task_id]
            seed = sample_seed(self.run_seed, ref.task_id) if self.cfg.seeded else None
            with self._lock:
                self._live_rollouts += 1
            w.rollout = self.runner.start(task, self.cfg.group_size,
                                          lambda out, w=w: self._finished(w, out), seed,
                                          on_engine_idle=self._engine_idle)  # fmt: skip

    def _finished(self, w: _TaskWork, out: GroupOutcome) -> None:
        """A group's episodes all ended (on an executor thread): ack, nack or drop its task."""
        self._count(out)
        try:
            self._settle(w, out)
        finally:
            with self._lock:
                self._live_rollouts -= 1
                self._lock.notify_all()

    def _settle(self, w: _TaskWork, out: GroupOutcome) -> None:
        if w.done:  # the lease died meanwhile: its task belongs to someone else now
            self._finish(w)
            return
        if out.status == "done":
            self._ack(w, out.episodes)
        elif out.status == "dropped":
            log.error("worker %s: task %d dropped after %d infrastructure failures: %s",
                      self.worker_id, w.ref.task_id, out.infra_failures, out.error)  # fmt: skip
            if out.fatal:  # a reward function that keeps failing: stop the job, naming it
                log.error("worker %s: %s; stopping the job", self.worker_id, out.fatal)
                self.coord.fail(out.fatal)
                self.request_stop()
            self.coord.drop(w.lease_id, [w.ref.task_id], out.infra_failures)
            self.stats["tasks_dropped"] += 1
            self._finish(w)
        else:
            if out.status == "failed":
                log.error("worker %s: task %d failed: %s", self.worker_id, w.ref.task_id,
                          out.error)  # fmt: skip
            self._nack(w)

    def _count(self, out: GroupOutcome) -> None:
        st = self.stats
        with self._lock:
            st["requests"] += out.requests
            st["generate_s"] += out.generate_s
            st["infra_failures"] += out.infra_failures
            for ep in out.episodes:
                st["turns"] += ep.num_turns
                st["observation_tokens"] += len(ep.completion_ids) - len(ep.versions)
                st["tool_calls"] += ep.usage.tool_calls
                st["tool_s"] += ep.usage.tool_s
                st["verify_s"] += ep.env_s
                st["prefill_tokens"] += ep.prefill_tokens
                st["reprefill_tokens"] += ep.reprefill_tokens
                st["infra_retried_episodes"] += ep.infra_retries > 0
                if ep.usage.sandbox_acquire_s >= 0:
                    st["sandbox_acquires"] += 1
                    st["sandbox_acquire_s"] += ep.usage.sandbox_acquire_s

    def _ack(self, w: _TaskWork, episodes: list[Episode]) -> None:
        samples = [episode_sample(ep) for ep in episodes]
        group = Group(task=w.ref, samples=samples, worker_id=self.worker_id)
        ok = self.coord.ack(w.lease_id, group)
        with self._lock:
            self.stats["groups_acked" if ok else "groups_rejected"] += 1
            self.stats["samples"] += len(samples)
            self.stats["tokens"] += sum(s.num_sampled for s in samples)
        self._finish(w)

    def _nack(self, w: _TaskWork) -> None:
        if not w.done:
            n = self.coord.nack(w.lease_id, [w.ref.task_id])
            with self._lock:
                self.stats["tasks_nacked"] += n
        self._finish(w)

    # ---- main loop -----------------------------------------------------------------------------

    def run(self) -> int:
        """Work until the coordinator says stop or request_stop(); returns the exit code (0)."""
        self.sync_weights()
        self.coord.report(self.worker_id, self.report())  # the job sees its counters from the start
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
                room = self._room()
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
            if w.rollout is not None:
                w.rollout.abort()
            self._nack(w)
        self._stop.set()
        # aborted groups close their environments (sandboxes back to the pool) as they end
        wait_until = time.monotonic() + max(10.0, self.cfg.drain_timeout_s)
        with self._lock:
            while self._live_rollouts and time.monotonic() < wait_until:
                self._lock.wait(0.05)
        self._pool.shutdown(wait=True)  # acks of groups mid-verification go out before we return
        self.runner.close()
        if self.agent is not None:
            self.agent.close()
        try:
            self.coord.report(self.worker_id, self.report())
        except (ConnectionError, EOFError, OSError):
            pass  # the trainer may already be gone at shutdown
