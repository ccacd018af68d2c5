"""Discrete-event simulation of slipstream's asynchronous RL loop, from a rates file.

What is simulated (one event heap, simulated seconds):

- **Trainer** (rl/controller.py): waits until `groups_per_step` fresh groups are buffered (the
  wait is trainer idle time), trains for a drawn step time (compute at its node count by Amdahl,
  plus EP all-to-all time from plan/ep.py, plus publish), then publishes version v + 1 and tells
  the coordinator; a per-step overhead follows.
- **Coordinator**: the real one (rl/coordinator.py over rl/queue.py's TaskQueue and
  rl/buffer.py's ExperienceBuffer: redelivery, fencing, staleness bound, admission rule), its
  queue reading the simulated clock. Live instances heartbeat, so their leases get a TTL that
  never runs out here; a reclaimed node's last heartbeat sets its leases' real deadline.
- **Rollout instances** (rl/worker.py + engine/native.py): the worker loop leases up to
  `tasks_per_lease` tasks while it has fewer than `max_inflight_tasks` generating and holds
  fewer than `max_inflight_tasks + max_scoring_tasks` (`rl.types.rollout_room`: a group being
  verified leaves its generation slot), backs off 5 -> 50 ms when nothing is granted, brings its engine to the store's latest version before starting a
  lease (fetch, then apply at a step boundary, pausing generation), and a watcher thread does the
  same every `weight_poll_s`; with `[weights] sync = "distributed"` the trainer's step holds
  the push to every live instance instead, and each applies the version at its next step
  boundary (no poll, no fetch). The engine runs continuous batching: a group is admitted whole when
  G KV slots are free; a step costs slowdown * (fixed + per_token * tokens in the forward) /
  throughput_scale; a sample's first token comes from the prefill step; a group's oldest token
  version is the engine's version when it was admitted (partial rollouts).
- **Verification**: per-sample latencies drawn from the verifier's distribution, served FIFO by
  the instance's threads or a shared sandbox pool; a group is acked when its slowest sample is.
- **Spot**: Poisson notices per Spot node; the worker stops leasing, in-flight work may finish
  for `drain_timeout_s`, the rest is nacked (back to the front of the queue: those samples are
  wasted); if the node is reclaimed first its leases expire after the TTL instead. A
  replacement instance starts `replace_s` after the reclaim.

Not covered: trainer failures and checkpoint/resume, dynamic sampling, CPU contention between
the simulated processes (a calibrated slowdown factor stands for it), network/storage limits
on weight distribution beyond a per-version fetch time, prefix caching.
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from slipstream.plan.dists import Sampler, dist_mean
from slipstream.plan.ep import ep_comm_s
from slipstream.plan.fifo_servers import ServerPool
from slipstream.plan.instance import Instance, Work, backoff_chain, wake_on_notify
from slipstream.plan.rates import PlanConfig
from slipstream.plan.results import SimResult, window_figures
from slipstream.plan.rollout import RolloutMixin
from slipstream.rl.buffer import ExperienceBuffer
from slipstream.rl.coordinator import Coordinator
from slipstream.rl.queue import TaskQueue
from slipstream.rl.types import Lease, rollout_room

INFINITE_TTL_S = 1e12  # live instances heartbeat: their leases never expire in the simulation
NUM_PROMPTS = 1 << 62  # the simulated train split: never wraps, a task id is its own prompt index


def tokens_per_step(plan: PlanConfig) -> float:
    """Tokens through the trainer per step: groups x G x (prompt + mean completion)."""
    eng = plan.rollout.engine
    mean_completion = min(max(dist_mean(eng.completion_tokens), 1.0), float(eng.max_new_tokens))
    lp = plan.loop
    return lp.groups_per_step * lp.group_size * (eng.prompt_tokens + mean_completion)


def trainer_step_parts_s(plan: PlanConfig, dispatch: str | None = None) -> tuple[float, float]:
    """(compute scale factor at the configured node count, EP all-to-all seconds per step)."""
    tr = plan.trainer
    p = tr.parallel_fraction
    scale = (1.0 - p) + p * tr.reference_num_nodes / tr.num_nodes
    comm = ep_comm_s(tr.ep, tokens_per_step(plan), tr.num_nodes, dispatch or tr.ep.dispatch)
    return scale, comm


class Simulator(RolloutMixin):
    """One run of the loop. `run()` returns a SimResult. The coordinator (`self.coordinator`,
    with its `queue` and `buffer`) is the real one on the simulated clock `self.now`; every call
    to it goes through `_call`, which integrates the number of leased tasks over time."""

    def __init__(self, plan: PlanConfig) -> None:
        self.plan = plan
        lp, ro, eng, vf = plan.loop, plan.rollout, plan.rollout.engine, plan.verifier
        self.rng = np.random.default_rng(lp.seed)
        self.now = 0.0
        self.queue = TaskQueue(NUM_PROMPTS, clock=lambda: self.now)
        self.buffer = ExperienceBuffer(lp.groups_per_step, lp.staleness_bound)
        self.coordinator = Coordinator(self.queue, self.buffer)
        self.trained_task_ids: list[int] = []
        # leased, unacked tasks after the last coordinator call, and their integral over time
        self._in_flight = 0
        self._in_flight_area = 0.0
        self._in_flight_t = 0.0
        self.G = lp.group_size
        self.step_sampler = Sampler(plan.trainer.step_s, self.rng)
        self.verify_sampler = Sampler(vf.latency_s, self.rng)
        self.len_sampler = Sampler(eng.completion_tokens, self.rng)
        self.step_scale, self.ep_s = trainer_step_parts_s(plan)
        k = eng.slowdown
        self.rpc_idle_s = ro.lease_rpc_s
        self.rpc_busy_s = ro.rpc_busy_s or ro.lease_rpc_s
        self.ack_busy_s = ro.rpc_busy_s or ro.ack_rpc_s
        self.fetch_s = eng.weight_fetch_s
        self.apply_s = eng.weight_apply_s
        self.a_s = k * eng.step_fixed_s / eng.throughput_scale
        self.c_s = k * eng.step_per_token_s / eng.throughput_scale
        self.cap_s = ro.lease_backoff_max_s
        num_spot = round(ro.spot_fraction * ro.num_instances)
        self.instances = [Instance(i, spot=i < num_spot) for i in range(ro.num_instances)]
        self.shared_pool = ServerPool(vf.num_sandboxes) if vf.pool == "shared" else None
        self.pools: dict[int, ServerPool] = {}
        self.spot_rate_per_s = ro.spot.interruptions_per_node_hour * ro.nodes_per_instance / 3600
        self.hb_period_s = min(ro.lease_ttl_s / 3, 1.0)
        self._events: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self._seq = 0
        self.num_events = 0
        self.store_version = 0
        self.blocked: set[int] = set()
        self.chain_eval: dict[int, tuple[float, int]] = {}  # idx -> (time, loop token)
        # trainer
        self.trainer_state = "waiting"
        self.wait_start_s = 0.0
        self.step_end_s: list[float] = []
        self.idle_s: list[float] = []
        self.train_s: list[float] = []
        self.finished = False
        # accounting
        self.request_latency_s: list[float] = []
        self.lease_time_s: dict[int, float] = {}
        self.in_flight_durations_s: list[float] = []
        self.wasted_samples = 0
        self.wasted_tokens = 0
        self.num_interruptions = 0
        self.num_nacked_tasks = 0
        self.num_abandoned_tasks = 0
        self.engine_busy_s = 0.0
        self.staleness_violations = 0
        self._stale_counted = 0

    # ---- coordinator calls ---------------------------------------------------------------------

    def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)` on the coordinator now, keeping the in-flight integral (Little's law):
        the count is constant between calls. Reading the count after the call reaps leases past
        their deadline now, as the next call would (each such deadline has its own `_reap`
        event, so this changes nothing but at exactly equal times)."""
        self._in_flight_area += self._in_flight * (self.now - self._in_flight_t)
        self._in_flight_t = self.now
        result = fn(*args)
        self._in_flight = self.queue.num_in_flight()
        return result

    # ---- event plumbing ------------------------------------------------------------------------

    def at(self, t: float, fn: Callable[..., None], *args: Any) -> None:
        self._seq += 1
        heapq.heappush(self._events, (t, self._seq, fn, args))

    def _live(self, inst: Instance, gen: int) -> bool:
        return inst.alive and inst.gen == gen

    def _rpc(self, inst: Instance) -> float:
        """Round trip of one coordinator call from this instance's worker now: slower while its
        engine thread is stepping (the worker's threads share one interpreter lock)."""
        return self.rpc_busy_s if inst.stepping else self.rpc_idle_s

    def run(self) -> SimResult:
        t0 = time.perf_counter()
        ro = self.plan.rollout
        for inst in self.instances:
            self.at(ro.startup_s, self._inst_start, inst)
        self.at(0.0, self._trainer_try)
        while self._events and not self.finished:
            t, _, fn, args = heapq.heappop(self._events)
            self.now = t
            self.num_events += 1
            fn(*args)
        if not self.finished:
            raise RuntimeError(
                f"simulation stalled at t={self.now:.3f} s after {len(self.step_end_s)} of "
                f"{self.plan.loop.steps} steps: no event left (is every instance dead?)"
            )
        for inst in self.instances:
            if inst.alive:
                inst.up_time_s += self.now - inst.up_since_s
        return self._result(time.perf_counter() - t0)

    def _result(self, wall_s: float) -> SimResult:
        """The run's figures (SimResult) once it finished."""
        sim = self
        lp = sim.plan.loop
        spp = [float(lp.groups_per_step * lp.group_size)] * len(sim.step_end_s)
        sps, idle, window = window_figures(sim.step_end_s, sim.idle_s, spp, lp.warmup_steps)
        t = sim.now
        stats = sim.queue.stats()
        in_flight_area = sim._in_flight_area + sim._in_flight * (t - sim._in_flight_t)
        num_inst = max(1, len(sim.instances))
        durations = sim.in_flight_durations_s
        return SimResult(
            steps=len(sim.step_end_s),
            warmup_steps=lp.warmup_steps,
            samples_per_s=sps,
            trainer_idle_frac=idle,
            window_s=window,
            sim_time_s=t,
            staleness_hist=dict(sorted(sim.buffer.staleness_hist.items())),
            staleness_bound=lp.staleness_bound,
            staleness_violations=sim.staleness_violations,
            wasted_samples=sim.wasted_samples,
            wasted_tokens=sim.wasted_tokens,
            dropped_stale_groups=sim.buffer.num_dropped_stale,
            rejected_acks=stats.num_rejected_acks,
            nacked_tasks=sim.num_nacked_tasks,
            abandoned_tasks=sim.num_abandoned_tasks,
            expired_leases=stats.num_expired_leases,
            interruptions=sim.num_interruptions,
            mean_request_latency_s=float(np.mean(sim.request_latency_s))
            if sim.request_latency_s
            else float("nan"),
            num_requests=len(sim.request_latency_s),
            mean_train_s=float(np.mean(sim.train_s)) if sim.train_s else float("nan"),
            mean_in_flight=in_flight_area / t if t > 0 else 0.0,
            mean_in_flight_time_s=float(np.mean(durations)) if durations else float("nan"),
            completion_rate_per_s=len(durations) / t if t > 0 else 0.0,
            rollout_busy_frac=sim.engine_busy_s / (t * num_inst) if t > 0 else 0.0,
            instance_up_frac=sum(i.up_time_s for i in sim.instances) / (t * num_inst)
            if t > 0
            else 0.0,
            num_events=sim.num_events,
            wall_s=wall_s,
        )

    # ---- trainer -------------------------------------------------------------------------------

    def _trainer_try(self) -> None:
        if self.trainer_state != "waiting" or self.finished:
            return
        batch = self._call(self.coordinator.get_batch, self.plan.loop.groups_per_step, 0.0)
        self._after_stale_drop()
        if batch is None:
            return
        self.trained_task_ids.extend(batch.task_ids)
        bound = self.plan.loop.staleness_bound
        self.staleness_violations += sum(1 for s in batch.staleness if s > bound)
        self.idle_s.append(self.now - self.wait_start_s)
        step = self.step_sampler.draw_one() * self.step_scale + self.ep_s
        step += self.plan.trainer.publish_s
        w = self.plan.weights
        if w.sync == "distributed":  # the push (and a due store copy) inside the step
            v = self.coordinator.version() + 1
            step += w.push_seconds(sum(1 for i in self.instances if i.alive))
            step += w.store_write_s if v == 1 or v % w.store_every == 0 else 0.0
        self.train_s.append(step)
        self.trainer_state = "training"
        self.at(self.now + step, self._train_done)

    def _after_stale_drop(self) -> None:
        dropped = self.buffer.num_dropped_stale * self.G
        if dropped > self._stale_counted:
            self.wasted_samples += dropped - self._stale_counted
            self._stale_counted = dropped
            self._slots_changed()

    def _train_done(self) -> None:
        self._after_stale_drop()
        v = self.coordinator.version() + 1
        self.coordinator.set_version(v)
        self.store_version = v
        self.step_end_s.append(self.now)
        if len(self.step_end_s) >= self.plan.loop.steps:
            self.finished = True
            return
        pushed = self.plan.weights.sync == "distributed"
        for inst in self.instances:
            if inst.alive and pushed:
                self._push_arrived(inst, v)
            elif inst.alive:
                self._schedule_watch(inst)
        self._slots_changed()
        self.trainer_state = "overhead"
        self.at(self.now + self.plan.trainer.overhead_s, self._trainer_wait)

    def _trainer_wait(self) -> None:
        self.trainer_state = "waiting"
        self.wait_start_s = self.now
        self._trainer_try()

    # ---- instance lifecycle --------------------------------------------------------------------

    def _inst_start(self, inst: Instance) -> None:
        ro, vf = self.plan.rollout, self.plan.verifier
        inst.gen += 1
        inst.alive, inst.draining = True, False
        inst.inflight.clear()
        inst.leases.clear()
        inst.queue.clear()
        inst.tau, inst.active_rows = 0, 0
        inst.row_heap, inst.work_heap = [], []
        inst.works.clear()
        inst.stepping, inst.loading, inst.pending_apply = False, False, None
        inst.version = self.store_version
        inst.idle_s = ro.lease_backoff_min_s
        inst.waiting = ""
        inst.watcher_origin_s = self.now  # the watcher thread starts with the worker
        inst.watcher_scheduled_s = math.inf
        inst.watcher_blocked = False
        inst.up_since_s = self.now
        if vf.pool == "per_instance":
            self.pools[inst.idx] = ServerPool(vf.concurrency_per_instance)
        if inst.spot and self.spot_rate_per_s > 0:
            t = self.now + float(self.rng.exponential(1.0 / self.spot_rate_per_s))
            self.at(t, self._spot_notice, inst, inst.gen)
        self._iterate(inst, inst.gen, inst.loop_token)

    def _spot_notice(self, inst: Instance, gen: int) -> None:
        if not self._live(inst, gen):
            return
        sp = self.plan.rollout.spot
        self.num_interruptions += 1
        inst.draining = True
        inst.loop_token += 1
        self._unblock(inst)
        reclaim_s = self.now + sp.notice_s
        if sp.drain_timeout_s < sp.notice_s:
            self.at(self.now + sp.drain_timeout_s, self._drain_deadline, inst, gen)
        self.at(reclaim_s, self._reclaim, inst, gen)
        self.at(reclaim_s + sp.replace_s, self._inst_start, inst)
        self._maybe_drained(inst)

    def _maybe_drained(self, inst: Instance) -> None:
        if (
            inst.draining
            and inst.alive
            and inst.num_inflight() == 0
            and inst.waiting not in ("sync", "version_rpc")
        ):
            self._worker_exit(inst)

    def _drain_deadline(self, inst: Instance, gen: int) -> None:
        """rl/worker.py `_drain`: what did not finish in time is aborted and nacked."""
        if not self._live(inst, gen):
            return
        for w in list(inst.inflight.values()):
            self._abort(inst, w)
        for lease_id, tids in list(inst.leases.items()):
            if tids:
                self.num_nacked_tasks += self._call(self.coordinator.nack, lease_id, sorted(tids))
        inst.leases.clear()
        self._slots_changed()
        self._worker_exit(inst)

    def _reclaim(self, inst: Instance, gen: int) -> None:
        if not self._live(inst, gen):
            return
        ttl = self.plan.rollout.lease_ttl_s
        last_beat = self.now - float(self.rng.uniform(0, self.hb_period_s))
        for lease_id, tids in inst.leases.items():
            if tids:
                left_s = max(ttl - (self.now - last_beat), 1e-6)
                if self._call(self.coordinator.extend, lease_id, left_s):
                    self.at(self.now + left_s, self._reap)  # the lease's deadline
        for w in list(inst.inflight.values()):
            self._abort(inst, w)
            self.num_abandoned_tasks += 1
        inst.leases.clear()
        self._worker_exit(inst)

    def _reap(self) -> None:
        """A reclaimed node's lease reached its deadline: the queue takes its tasks back at the
        next call that reaps (this one)."""
        before = self._in_flight
        if self._call(self.queue.num_in_flight) < before:
            self._slots_changed()

    def _worker_exit(self, inst: Instance) -> None:
        inst.alive = False
        inst.up_time_s += self.now - inst.up_since_s
        inst.loop_token += 1
        self._unblock(inst)

    def _unblock(self, inst: Instance) -> None:
        self.blocked.discard(inst.idx)
        self.chain_eval.pop(inst.idx, None)

    def _abort(self, inst: Instance, w: Work) -> None:
        """A task's work is thrown away (drain deadline or reclaim): its samples are wasted."""
        w.done = True
        inst.inflight.pop(w.task_id, None)
        self.wasted_samples += self.G
        if w.admitted and inst.works.pop(w.ix, None) is not None:
            produced = inst.tau - w.tau_start
            inst.active_rows -= int((w.lengths > produced).sum())
            self.wasted_tokens += int(np.minimum(w.lengths, produced).sum())
        elif w in inst.queue:
            inst.queue.remove(w)

    # ---- worker loop ---------------------------------------------------------------------------

    def _iterate(self, inst: Instance, gen: int, token: int) -> None:
        if not self._live(inst, gen) or inst.draining or token != inst.loop_token:
            return
        room = self._room(inst)
        if room > 0:  # stopping() + lease() round trips; the lease is decided when they are done
            inst.waiting = ""
            self.at(self.now + 2 * self._rpc(inst), self._lease_eval, inst, gen, inst.loop_token)
        else:
            inst.waiting = "room"
            inst.wait_start_s, inst.wait_len_s = self.now + self._rpc(inst), inst.idle_s

    def _room(self, inst: Instance) -> int:
        ro = self.plan.rollout
        return rollout_room(ro.max_inflight_tasks, ro.max_inflight_tasks + ro.max_scoring_tasks,
                            inst.num_generating(), inst.num_inflight())  # fmt: skip

    def _lease_eval(self, inst: Instance, gen: int, token: int) -> None:
        if not self._live(inst, gen) or inst.draining or token != inst.loop_token:
            return
        ro = self.plan.rollout
        room = self._room(inst)
        lease: Lease | None = self._call(self.coordinator.lease, inst.worker_id,
                                         min(room, ro.tasks_per_lease), INFINITE_TTL_S)  # fmt: skip
        if lease is None:
            inst.waiting = "admission"
            inst.wait_start_s, inst.wait_len_s = self.now, inst.idle_s
            self.chain_eval.pop(inst.idx, None)
            self.blocked.add(inst.idx)
            return
        lease_id, policy_version = lease.lease_id, lease.policy_version
        task_ids = [t.task_id for t in lease.tasks]
        for tid in task_ids:
            self.lease_time_s[tid] = self.now
        inst.idle_s = ro.lease_backoff_min_s
        inst.leases[lease_id] = set(task_ids)
        inst.sync_lease, inst.sync_min_version = (lease_id, task_ids), policy_version
        inst.waiting = "version_rpc"
        # sync_weights asks the coordinator for its version (one more round trip) first
        self.at(self.now + self._rpc(inst), self._sync_after_rpc, inst, gen)

    def _sync_after_rpc(self, inst: Instance, gen: int) -> None:
        if self._live(inst, gen):
            inst.waiting = "sync"
            self._sync(inst)

    def _sync(self, inst: Instance) -> None:
        """The run loop's sync_weights before starting a lease: load the store's latest if newer
        (waiting for the watcher's load first if one is in progress), then start the tasks."""
        if inst.loading:
            return  # resumed by _load_finished
        if self.store_version > inst.version:
            self._load_start(inst, self.store_version, "loop")
            return
        assert inst.sync_lease is not None
        lease_id, task_ids = inst.sync_lease
        inst.sync_lease = None
        inst.waiting = ""
        self._start_tasks(inst, lease_id, task_ids)
        if inst.draining:
            self._maybe_drained(inst)
            return
        self._iterate(inst, inst.gen, inst.loop_token)

    def _notify(self, inst: Instance) -> None:
        """One of the instance's tasks finished: a waiting loop wakes."""
        if inst.waiting not in ("room", "admission") or inst.draining:
            return
        rpc = self._rpc(inst) if inst.waiting == "room" else 2 * self._rpc(inst)
        t_wake, inst.idle_s = wake_on_notify(inst.wait_start_s, inst.wait_len_s, self.now, rpc,
                                             self.cap_s)  # fmt: skip
        inst.waiting = ""
        self._unblock(inst)
        inst.loop_token += 1
        self.at(t_wake, self._iterate, inst, inst.gen, inst.loop_token)

    def _slots_changed(self) -> None:
        """Admission slots may have grown: each blocked worker asks again at its next poll."""
        for idx in list(self.blocked):
            inst = self.instances[idx]
            t_eval, idle = backoff_chain(inst.wait_start_s, inst.wait_len_s, self.now,
                                         2 * self._rpc(inst), self.cap_s)  # fmt: skip
            scheduled = self.chain_eval.get(idx)
            if scheduled is not None and scheduled[1] == inst.loop_token and scheduled[0] <= t_eval:
                continue
            self.chain_eval[idx] = (t_eval, inst.loop_token)
            self.at(t_eval, self._chain_eval, inst, inst.gen, inst.loop_token, idle, t_eval)

    def _chain_eval(self, inst: Instance, gen: int, token: int, idle: float, t: float) -> None:
        if self.chain_eval.get(inst.idx) != (t, token) or inst.waiting != "admission":
            return
        if not self._live(inst, gen) or token != inst.loop_token or inst.draining:
            return
        self._unblock(inst)
        inst.idle_s = idle
        self._lease_eval(inst, gen, token)
