"""The rollout instance's internals in the simulation: weight following, the continuous-batching
engine, verification and acks (a mixin of `sim.Simulator`, which owns the event heap, the
coordinator state and the worker loop).

Engine model: a token clock per instance counts the tokens every running row has produced; a
row admitted at clock t0 with length L finishes at t0 + L, a group when its longest row does.
One simulated step advances the clock by `token_quantum` tokens and costs slowdown * (fixed +
per_token * tokens in the forward) / throughput_scale per token step (the first step of admitted
groups also prefills their prompts). A pending weight version is applied at a step boundary
(pausing the engine for `weight_apply_s`); with `partial_rollouts` off, only once no row runs.

Not covered: chunked prefill, preemption, per-row KV growth (the per-token cost is constant).
"""

from __future__ import annotations

import heapq
import math

import numpy as np

from slipstream.plan.instance import Instance, Work
from slipstream.rl.types import Group, Sample, TaskRef


class RolloutMixin:
    """Methods of Simulator that model one rollout instance (see the module docstring). They use
    the Simulator's state (`now`, `plan`, `at`, the instances' fields, `coordinator`, `_call`);
    this module does not import sim.py, so the mixin is not typed against it."""

    # ---- weights -------------------------------------------------------------------------------

    def _load_start(self, inst: Instance, version: int, by: str) -> None:
        inst.loading = True
        inst.load_by = by
        self.at(self.now + self.fetch_s, self._fetch_done, inst, inst.gen, version)

    def _fetch_done(self, inst: Instance, gen: int, version: int) -> None:
        if not self._live(inst, gen):
            return
        inst.pending_apply = version
        self._engine_kick(inst)

    def _push_arrived(self, inst: Instance, version: int) -> None:
        """weights.sync = distributed: the trainer's push left `version` staged in the engine
        (the push's time was the trainer's); applied at the next step boundary. A worker that
        wants the version meanwhile waits for that apply, as for a load."""
        inst.loading = True
        inst.load_by = "push"
        inst.pending_apply = version
        self._engine_kick(inst)

    def _apply_done(self, inst: Instance, gen: int) -> None:
        if not self._live(inst, gen):
            return
        assert inst.pending_apply is not None
        self.engine_busy_s += self.apply_s
        inst.version = inst.pending_apply
        inst.pending_apply = None
        inst.stepping = False
        inst.loading = False
        self._load_finished(inst)
        self._engine_kick(inst)

    def _load_finished(self, inst: Instance) -> None:
        by_watcher = inst.load_by == "watcher"
        if inst.waiting == "sync":
            self._sync(inst)  # the run loop takes the lock first (it may load again)
        if inst.loading:
            return
        if inst.watcher_blocked:
            inst.watcher_blocked = False
            self._watch_sync(inst)
        elif by_watcher:
            inst.watcher_origin_s = self.now
            if self.store_version > inst.version:
                self._schedule_watch(inst)

    def _schedule_watch(self, inst: Instance) -> None:
        poll = self.plan.rollout.weight_poll_s
        n = max(1, math.ceil((self.now - inst.watcher_origin_s) / poll - 1e-12))
        t = inst.watcher_origin_s + n * poll
        if t < inst.watcher_scheduled_s:
            inst.watcher_scheduled_s = t
            self.at(t, self._watch_tick, inst, inst.gen, t)

    def _watch_tick(self, inst: Instance, gen: int, t: float) -> None:
        if not self._live(inst, gen) or inst.watcher_scheduled_s != t:
            return
        inst.watcher_scheduled_s = math.inf
        if inst.loading:
            inst.watcher_blocked = True
            return
        self._watch_sync(inst)

    def _watch_sync(self, inst: Instance) -> None:
        inst.watcher_origin_s = self.now
        if self.store_version > inst.version:
            self._load_start(inst, self.store_version, "watcher")

    # ---- engine --------------------------------------------------------------------------------

    def _start_tasks(self, inst: Instance, lease_id: int, task_ids: list[int]) -> None:
        eng = self.plan.rollout.engine
        per_group = eng.length_per == "group"
        for tid in task_ids:
            drawn = self.len_sampler.draw(1 if per_group else self.G)
            if per_group:
                drawn = np.repeat(drawn, self.G)
            lengths = np.clip(np.rint(drawn), 1, eng.max_new_tokens)
            w = Work(tid, lease_id, lengths.astype(np.int64), self.now, ix=inst.next_work_ix)
            inst.next_work_ix += 1
            inst.inflight[tid] = w
            inst.queue.append(w)
        self._engine_kick(inst)

    def _engine_kick(self, inst: Instance) -> None:
        if inst.stepping or not inst.alive:
            return
        partial = self.plan.loop.partial_rollouts
        if inst.pending_apply is not None and (partial or inst.num_rows == 0):
            inst.stepping = True
            self.at(self.now + self.apply_s, self._apply_done, inst, inst.gen)
            return
        if inst.num_rows or (inst.queue and inst.pending_apply is None):
            self._engine_step(inst)

    def _engine_step(self, inst: Instance) -> None:
        eng = self.plan.rollout.engine
        running = inst.num_rows
        admitted: list[Work] = []
        if inst.pending_apply is None or self.plan.loop.partial_rollouts:
            free = eng.max_batch_rows - running
            while inst.queue and self.G <= free:
                w = inst.queue.pop(0)
                admitted.append(w)
                free -= self.G
        for w in admitted:
            w.admitted = True
            w.oldest_version = inst.version
            w.tau_start = inst.tau
            inst.works[w.ix] = w
            inst.active_rows += self.G
            for length in w.lengths.tolist():
                heapq.heappush(inst.row_heap, (inst.tau + length, w.ix))
            heapq.heappush(inst.work_heap, (inst.tau + int(w.lengths.max()), w.ix))
        if inst.num_rows == 0:
            return
        q = eng.token_quantum
        first = self.a_s + self.c_s * (running + eng.prompt_tokens * len(admitted))
        dur = first + (q - 1) * (self.a_s + self.c_s * inst.num_rows)
        inst.stepping = True
        self.engine_busy_s += dur
        self.at(self.now + dur, self._step_done, inst, inst.gen)

    def _step_done(self, inst: Instance, gen: int) -> None:
        if not self._live(inst, gen):
            return
        inst.stepping = False
        inst.tau += self.plan.rollout.engine.token_quantum
        rows, works = inst.row_heap, inst.work_heap
        while rows and rows[0][0] <= inst.tau:
            _, ix = heapq.heappop(rows)
            if ix in inst.works:  # rows of an aborted group were already taken off
                inst.active_rows -= 1
        while works and works[0][0] <= inst.tau:
            _, ix = heapq.heappop(works)
            w = inst.works.pop(ix, None)
            if w is not None:
                self._generated(inst, w)
        self._engine_kick(inst)

    # ---- verification and acks -----------------------------------------------------------------

    def _generated(self, inst: Instance, w: Work) -> None:
        w.generated_s = self.now
        self.request_latency_s.append(self.now - w.submitted_s)
        if w.done:
            return
        if not inst.draining:  # it left its generation slot: a loop waiting for room wakes
            self._notify(inst)
        pool = self.shared_pool or self.pools[inst.idx]
        end = pool.submit(self.now, self.verify_sampler.draw(self.G).tolist())
        # acks go out from the verification threads, which contend with each other and with
        # the engine thread for the interpreter lock: the busy round trip
        self.at(end + self.ack_busy_s, self._acked, inst, inst.gen, w)

    def _acked(self, inst: Instance, gen: int, w: Work) -> None:
        if not self._live(inst, gen) or w.done:
            return
        # One sample stands for the group's G: the buffer reads only the group's oldest token
        # version (staleness), and the simulator counts samples itself; G copies would make each
        # get_batch's staleness scan over the buffered groups G times slower.
        sample = Sample([], [0], [0.0], [w.oldest_version])
        group = Group(TaskRef(w.task_id, w.task_id), [sample], worker_id=inst.worker_id)
        ok = self._call(self.coordinator.ack, w.lease_id, group)
        if not ok:
            self.wasted_samples += self.G
        else:
            self.in_flight_durations_s.append(self.now - self.lease_time_s.pop(w.task_id))
        w.done = True
        inst.inflight.pop(w.task_id, None)
        rest = inst.leases.get(w.lease_id)
        if rest is not None:
            rest.discard(w.task_id)
            if not rest:
                del inst.leases[w.lease_id]
        if self.trainer_state == "waiting":
            self._trainer_try()
        if inst.draining:
            self._maybe_drained(inst)
        else:
            self._notify(inst)
