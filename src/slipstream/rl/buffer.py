"""ExperienceBuffer: complete groups waiting for the trainer, with a staleness bound and admission
control.

Contract:
- Staleness of a group at trainer version v = v - (version of its oldest token). `get_batch`
  never returns a group whose staleness exceeds `max_staleness`; such groups are dropped, counted
  as wasted, and handed to `on_stale` (the coordinator requeues their tasks: nothing is lost).
- Admission control (AReaL's staleness manager): at trainer version v, at most
  (max_staleness + 1 + v) * groups_per_step groups may have been handed out in total (trained +
  buffered + in flight). A task leased at version v is then trained by version v + max_staleness
  at the latest, as long as the trainer takes groups oldest first (it does) and workers generate
  with weights at least as new as the lease's version (the worker's contract) — so little
  generation is wasted. Dropped groups free their slot (that is the over-sampling that keeps batch
  sizes full under dynamic sampling).
- Dynamic sampling (optional, DAPO's): a group whose rewards are all equal carries no GRPO signal
  and is dropped at `put`, so batches fill with groups that do. Refilling is bounded by its
  expected cost: a uniform group is dropped only while at least `min_signal_share` of the last
  `signal_window_groups` groups put (kept or dropped) carried signal, i.e. while refilling costs
  at most 1 / min_signal_share generated groups per trained one on average. Below that (a
  random initialisation, where nearly every group is uniform, or a task the policy has
  mastered) uniform groups are kept and trained as without dynamic sampling (counted as
  `kept_uniform`), so a job never waits on a batch that cannot fill. Until the window holds
  `signal_window_groups` groups nothing is dropped. DAPO's own bound (`max_num_gen_batches`)
  counts generation batches per step and then errors out; a per-step count would either let a
  random-init job generate that many batches per step or cut the measured quickstart runs'
  tail (62-67 drops per 8-group step at p99, docs/rl.md).
- Episode accounting (what the run's report shows about rollouts): every group `put` adds its
  samples' turns, tool calls, environment time, sandbox acquire waits and infrastructure
  retries, and the time in tool runs; `count_dropped_infra` adds the tasks given up after repeated infrastructure failures
  (never trained). `metrics()` reports per-episode means, acquire p50/p99 (over the last
  ACQUIRE_WINDOW episodes that held a sandbox), infra failures, retried episodes and drops.

Not covered: persistence by itself (the checkpoint writes `snapshot()`), priorities.
"""

from __future__ import annotations

import base64
import dataclasses
import threading
from collections import Counter, deque
from collections.abc import Callable
from typing import Any

from slipstream.rl.types import Batch, Group, Sample, TaskRef

ACQUIRE_WINDOW = 4096  # recent sandbox acquire waits kept for the percentiles (and checkpoints)
_EPISODE_COUNTERS = ("episodes", "turns", "tool_calls", "env_s", "tool_s", "observation_tokens",
                     "infra_failures", "infra_retried_episodes", "dropped_infra")  # fmt: skip


def _percentile(samples: list[float], q: float) -> float | None:
    if not samples:
        return None
    s = sorted(samples)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def group_to_dict(g: Group) -> dict[str, Any]:
    """JSON-ready (recorded routing as base64)."""
    d = dataclasses.asdict(g)
    for s in d["samples"]:
        s["routed_experts"] = base64.b64encode(s["routed_experts"]).decode()
    return d


def group_from_dict(d: dict[str, Any]) -> Group:
    def sample(s: dict[str, Any]) -> Sample:
        return Sample(**{**s, "routed_experts": base64.b64decode(s.get("routed_experts", ""))})

    return Group(
        task=TaskRef(**d["task"]),
        samples=[sample(s) for s in d["samples"]],
        worker_id=d.get("worker_id", ""),
        lease_id=d.get("lease_id", -1),
    )


class ExperienceBuffer:
    """Thread-safe; the queue's ack calls `put` and the trainer calls `get_batch`."""

    def __init__(
        self,
        groups_per_step: int,
        max_staleness: int,
        *,
        dynamic_sampling: bool = False,
        min_signal_share: float = 0.1,
        signal_window_groups: int = 64,
        on_stale: Callable[[list[Group]], None] | None = None,
    ) -> None:
        if groups_per_step < 1 or max_staleness < 0:
            raise ValueError(
                f"need groups_per_step >= 1 and max_staleness >= 0, got {groups_per_step}, "
                f"{max_staleness}"
            )
        if not 0.0 < min_signal_share <= 1.0 or signal_window_groups < 1:
            raise ValueError(
                f"need 0 < min_signal_share <= 1 and signal_window_groups >= 1, got "
                f"{min_signal_share}, {signal_window_groups}"
            )
        self.groups_per_step = groups_per_step
        self.max_staleness = max_staleness
        self.dynamic_sampling = dynamic_sampling
        self.min_signal_share = min_signal_share
        # whether each of the last signal_window_groups groups put had unequal rewards
        self._signal: deque[bool] = deque(maxlen=signal_window_groups)
        self.on_stale = on_stale
        self._lock = threading.Lock()
        self._groups: list[Group] = []
        self.num_consumed = 0
        self.num_put = 0
        self.num_dropped_stale = 0
        self.num_dropped_uniform = 0
        self.num_kept_uniform = 0  # uniform groups trained because refilling cost too much
        self.num_wasted_samples = 0
        self.staleness_hist: Counter[int] = Counter()
        self.episode_counts: dict[str, float] = dict.fromkeys(_EPISODE_COUNTERS, 0)
        self.acquire_s: deque[float] = deque(maxlen=ACQUIRE_WINDOW)

    def _count_episodes(self, group: Group) -> None:
        c = self.episode_counts
        for s in group.samples:
            c["episodes"] += 1
            c["turns"] += s.num_turns
            c["tool_calls"] += s.tool_calls
            c["env_s"] += s.env_s
            c["tool_s"] += s.tool_s
            c["observation_tokens"] += len(s.completion_ids) - s.num_sampled
            c["infra_failures"] += s.infra_retries
            c["infra_retried_episodes"] += s.infra_retries > 0
            if s.sandbox_acquire_s >= 0:
                self.acquire_s.append(s.sandbox_acquire_s)

    def count_dropped_infra(self, num_tasks: int, infra_failures: int) -> None:
        """Tasks given up after repeated infrastructure failures (and those failures)."""
        with self._lock:
            self.episode_counts["dropped_infra"] += num_tasks
            self.episode_counts["infra_failures"] += infra_failures

    def put(self, group: Group) -> bool:
        """Add a complete group. False if dynamic sampling dropped it."""
        if not group.samples:
            raise ValueError(f"group for task {group.task.task_id} has no samples")
        with self._lock:
            self.num_put += 1
            self._count_episodes(group)
            uniform = len(set(group.rewards)) == 1
            affordable = self._refill_affordable()  # judged on the groups before this one
            self._signal.append(not uniform)
            if self.dynamic_sampling and uniform:
                if affordable:
                    self.num_dropped_uniform += 1
                    self.num_wasted_samples += len(group.samples)
                    return False
                self.num_kept_uniform += 1
            self._groups.append(group)
            return True

    def _refill_affordable(self) -> bool:
        window = self._signal
        return len(window) == window.maxlen and sum(window) >= self.min_signal_share * len(window)

    def _drop_stale(self, current_version: int) -> list[Group]:
        keep, stale = [], []
        for g in self._groups:
            if current_version - g.oldest_version > self.max_staleness:
                self.num_dropped_stale += 1
                self.num_wasted_samples += len(g.samples)
                stale.append(g)
            else:
                keep.append(g)
        self._groups = keep
        return stale

    def get_batch(self, n: int, current_version: int) -> Batch | None:
        """n groups, oldest first (ties by task id), or None when fewer than n are fresh enough."""
        with self._lock:
            stale = self._drop_stale(current_version)
            batch = self._take(n, current_version)
        if stale and self.on_stale is not None:
            self.on_stale(stale)  # outside our lock: the queue's lock is taken before ours in put
        return batch

    def _take(self, n: int, current_version: int) -> Batch | None:
        if len(self._groups) < n:
            return None
        self._groups.sort(key=lambda g: (g.oldest_version, g.task.task_id))
        taken, self._groups = self._groups[:n], self._groups[n:]
        taken.sort(key=lambda g: g.task.task_id)
        staleness = [current_version - min(g.oldest_version, current_version) for g in taken]
        for s in staleness:
            self.staleness_hist[s] += 1
        self.num_consumed += n
        return Batch(groups=taken, trainer_version=current_version, staleness=staleness)

    def admission_slots(self, current_version: int, num_in_flight: int) -> int:
        """How many more tasks may be leased now without risking samples too stale to train."""
        with self._lock:
            cap = (self.max_staleness + 1 + current_version) * self.groups_per_step
            return max(0, cap - (self.num_consumed + len(self._groups) + num_in_flight))

    def __len__(self) -> int:
        with self._lock:
            return len(self._groups)

    def metrics(self) -> dict[str, Any]:
        with self._lock:
            c = self.episode_counts
            n = max(1.0, c["episodes"])
            waits = list(self.acquire_s)
            signal = self._signal
            return {
                "buffered": len(self._groups),
                "consumed": self.num_consumed,
                "dropped_stale": self.num_dropped_stale,
                "dropped_uniform": self.num_dropped_uniform,
                "kept_uniform": self.num_kept_uniform,
                "signal_share": round(sum(signal) / len(signal), 4) if signal else None,
                "wasted_samples": self.num_wasted_samples,
                "staleness_hist": {str(k): v for k, v in sorted(self.staleness_hist.items())},
                "episodes": int(c["episodes"]),
                "turns_per_episode": round(c["turns"] / n, 4),
                "tool_calls_per_episode": round(c["tool_calls"] / n, 4),
                "env_s_per_episode": round(c["env_s"] / n, 6),
                "tool_s_per_episode": round(c["tool_s"] / n, 6),
                "observation_tokens_per_episode": round(c["observation_tokens"] / n, 3),
                "sandbox_acquire_p50_s": _percentile(waits, 0.5),
                "sandbox_acquire_p99_s": _percentile(waits, 0.99),
                "infra_failures": int(c["infra_failures"]),
                "infra_retried_episodes": int(c["infra_retried_episodes"]),
                "dropped_infra": int(c["dropped_infra"]),
            }

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {
                "groups": [group_to_dict(g) for g in self._groups],
                "num_consumed": self.num_consumed,
                "num_put": self.num_put,
                "num_dropped_stale": self.num_dropped_stale,
                "num_dropped_uniform": self.num_dropped_uniform,
                "num_kept_uniform": self.num_kept_uniform,
                "signal_window": list(self._signal),
                "num_wasted_samples": self.num_wasted_samples,
                "staleness_hist": dict(self.staleness_hist),
                "episode_counts": dict(self.episode_counts),
                "acquire_s": list(self.acquire_s),
            }

    def restore(self, state: dict[str, Any]) -> None:
        with self._lock:
            self._groups = [group_from_dict(d) for d in state["groups"]]
            self.num_consumed = state["num_consumed"]
            self.num_put = state["num_put"]
            self.num_dropped_stale = state["num_dropped_stale"]
            self.num_dropped_uniform = state["num_dropped_uniform"]
            # checkpoints from before the refill bound have neither (the window refills)
            self.num_kept_uniform = state.get("num_kept_uniform", 0)
            self._signal.clear()
            self._signal.extend(state.get("signal_window", []))
            self.num_wasted_samples = state["num_wasted_samples"]
            self.staleness_hist = Counter({int(k): v for k, v in state["staleness_hist"].items()})
            # checkpoints from before episode accounting have neither (counts start at 0)
            self.episode_counts = {**dict.fromkeys(_EPISODE_COUNTERS, 0),
                                   **state.get("episode_counts", {})}  # fmt: skip
            self.acquire_s = deque(state.get("acquire_s", []), maxlen=ACQUIRE_WINDOW)
