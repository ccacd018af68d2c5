"""Per-step metrics of the reward's components: what the trainer logs for each batch
(metrics.jsonl, TensorBoard) and the run report draws.

`component_metrics(samples)` -> for each component name seen in the batch's
`Sample.reward_components`: `reward/<name>/mean` (over the samples it scored, None excluded; NaN
when it scored none) and `reward/<name>/none` (the share of samples where it was None, not
applicable). Errors are counted where they happen (a failed call never reaches a batch): the
rollout workers' `reward_<name>_failed_calls` / `_dropped` counters (`/metrics`; summed into
each step's record by the controller as `reward/<name>/failed_calls` and `/dropped`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any


def component_metrics(samples: Iterable[Any]) -> dict[str, float]:
    """Mean and None share per component over `samples` (objects with `reward_components`)."""
    values: dict[str, list[float | None]] = {}
    for s in samples:
        for name, v in s.reward_components.items():
            values.setdefault(name, []).append(v)
    out: dict[str, float] = {}
    for name, vs in values.items():
        scored = [v for v in vs if v is not None]
        out[f"reward/{name}/mean"] = sum(scored) / len(scored) if scored else math.nan
        out[f"reward/{name}/none"] = (len(vs) - len(scored)) / len(vs)
    return out


def worker_error_totals(worker_stats: dict[str, dict[str, float]]) -> dict[str, float]:
    """`reward/<name>/failed_calls` and `/dropped`, summed over the workers' reports
    (`reward_<name>_<counter>`, RewardSet.stats) since the job started."""
    out: dict[str, float] = {}
    for stats in worker_stats.values():
        for key, v in stats.items():
            for counter in ("failed_calls", "dropped"):
                suffix = f"_{counter}"
                if key.startswith("reward_") and key.endswith(suffix):
                    name = key[len("reward_") : -len(suffix)]
                    k = f"reward/{name}/{counter}"
                    out[k] = out.get(k, 0.0) + v
    return out
