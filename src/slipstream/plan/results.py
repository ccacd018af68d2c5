"""What a simulation reports, and the same figures computed from a real run's metrics.jsonl.

Steady-state window: from the end of step `warmup_steps` to the end of the last step (the first
steps include pipeline fill and worker start-up, which a short validation run cannot amortise).
samples/s = samples trained in the window / window length; trainer idle fraction = time the
trainer waited for a batch inside the window / window length. `window_figures` computes both
from per-step end times and idle times, and `figures_from_metrics` applies it to a run's
metrics.jsonl (`elapsed_s`, `idle_s`, `num_samples` per step), so simulated and measured figures
are defined by the same code.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np


def window_figures(
    step_end_s: list[float], idle_s: list[float], samples_per_step: list[float], warmup: int
) -> tuple[float, float, float]:
    """(samples/s, trainer idle fraction, window seconds) over steps warmup+1 .. N (1-based)."""
    n = len(step_end_s)
    if n <= warmup:
        raise ValueError(f"need more than {warmup} steps, got {n}")
    t0 = step_end_s[warmup - 1] if warmup > 0 else 0.0
    window = step_end_s[-1] - t0
    if window <= 0:
        raise ValueError(f"empty measurement window ({window} s)")
    samples = float(sum(samples_per_step[warmup:]))
    idle = float(sum(idle_s[warmup:]))
    return samples / window, idle / window, window


def figures_from_metrics(records: list[dict[str, Any]], warmup: int) -> dict[str, float]:
    """The window figures of a real run (records of its metrics.jsonl), plus what calibration
    reads: train_s, overhead per step, mean completion length."""
    steps = [r for r in records if "train_s" in r and "elapsed_s" in r]
    if len(steps) <= warmup + 1:
        raise ValueError(f"run has {len(steps)} logged steps; need more than {warmup + 1}")
    end = [float(r["elapsed_s"]) for r in steps]
    idle = [float(r["idle_s"]) for r in steps]
    train = [float(r["train_s"]) for r in steps]
    samples = [float(r.get("num_samples", 0)) for r in steps]
    sps, idle_frac, window = window_figures(end, idle, samples, warmup)
    gaps = np.diff(end[warmup - 1 :] if warmup > 0 else [0.0, *end])
    overhead = gaps - np.asarray(idle[warmup:]) - np.asarray(train[warmup:])
    return {
        "samples_per_s": sps,
        "trainer_idle_frac": idle_frac,
        "window_s": window,
        "num_steps": float(len(steps)),
        "train_s_mean": float(np.mean(train[warmup:])),
        "train_s_median": float(np.median(train[warmup:])),
        "overhead_s_mean": float(max(0.0, np.mean(overhead))),
        "completion_len_mean": float(
            np.mean([r["completion_len_mean"] for r in steps if "completion_len_mean" in r])
        ),
        "first_step_idle_s": idle[0],
    }


@dataclass
class SimResult:
    steps: int
    warmup_steps: int
    samples_per_s: float
    trainer_idle_frac: float
    window_s: float
    sim_time_s: float
    staleness_hist: dict[int, int]
    staleness_bound: int
    staleness_violations: int
    wasted_samples: int
    wasted_tokens: int
    dropped_stale_groups: int
    rejected_acks: int
    nacked_tasks: int
    abandoned_tasks: int
    expired_leases: int
    interruptions: int
    mean_request_latency_s: float
    num_requests: int
    mean_train_s: float
    mean_in_flight: float
    mean_in_flight_time_s: float
    completion_rate_per_s: float
    rollout_busy_frac: float
    instance_up_frac: float
    num_events: int
    wall_s: float
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["staleness_hist"] = {str(k): v for k, v in self.staleness_hist.items()}
        return d
