"""Distributions the planner draws from: step times, verifier latencies, completion lengths.

A `Dist` is a config section (one TOML table) with a `kind`:

- `fixed`: always `value`.
- `exponential`: mean `value` (memoryless; the closed-form queueing cases).
- `lognormal`: median `p50`, tail ratio `p99_over_p50` (sigma = ln(ratio) / z99), the same
  parametrisation as the RL loop's `LatencyInjector` (rl/verifier.py), so a run's
  `rollout.verify_latency_*` settings map one to one.
- `empirical`: resampled uniformly from `values`, or replayed in order (`order = "sequential"`,
  e.g. a run's measured trainer step times, so its load fluctuations come back in sequence).
- `sweep`: resampled from a density sweep's raw `samples.csv` (`slipstream sweep run`): the
  successful latencies of one configuration (`config_id`, empty = the first in the file) at one
  `density`; failed samples are counted at `failed_as_s` (the sweep's timeout convention) when it
  is > 0, else dropped.

Every draw is then multiplied by `scale`, shifted by `shift` and clipped to [`min`, `max`].
Relative paths are resolved against the directory of the TOML file that names them
(`resolve_paths`). Imports numpy and pydantic only.

Not covered: correlated draws (each draw is independent), distributions with a time trend.
"""

from __future__ import annotations

import csv
import math
from functools import lru_cache
from pathlib import Path
from typing import Literal

import numpy as np
from pydantic import Field, model_validator

from slipstream.config.base import Section

# z-score of the 99th percentile of a standard normal (same constant as rl/verifier.py).
Z99 = 2.3263478740408408
_BLOCK = 4096  # draws made at once by a Sampler


class Dist(Section):
    """One distribution (see the module docstring for the kinds)."""

    kind: Literal["fixed", "exponential", "lognormal", "empirical", "sweep"] = "fixed"
    """`fixed`, `exponential`, `lognormal`, `empirical` or `sweep`."""
    value: float = 0.0
    """kind = fixed: the value; kind = exponential: the mean."""
    p50: float = Field(default=0.0, ge=0)
    """kind = lognormal: the median."""
    p99_over_p50: float = Field(default=1.0, ge=1)
    """kind = lognormal: p99 / p50 (1 = no spread)."""
    values: list[float] = Field(default_factory=list)
    """kind = empirical: the samples to resample from."""
    order: Literal["random", "sequential"] = "random"
    """kind = empirical: `random` resamples uniformly; `sequential` replays `values` in order,
    cyclically (a run's own step-time series, load fluctuations included)."""
    path: str = ""
    """kind = sweep: a sweep's samples.csv (relative paths: from the TOML file's directory)."""
    config_id: str = ""
    """kind = sweep: the sweep configuration to read (e.g. `bwrap/core/local/smt-off`); empty =
    the first configuration in the file."""
    density: float = Field(default=1.0, gt=0)
    """kind = sweep: sandboxes per vCPU of the cell to read (the closest measured density is
    used; `sweep_densities` lists them)."""
    failed_as_s: float = Field(default=0.0, ge=0)
    """kind = sweep: latency counted for a failed sample (0 = drop failed samples)."""
    scale: float = Field(default=1.0, gt=0)
    """Every draw is multiplied by this (e.g. to scale a dev-machine latency to a target)."""
    shift: float = 0.0
    """Added to every draw after scaling."""
    min: float | None = None
    """Lower clip of every draw (None = none)."""
    max: float | None = None
    """Upper clip of every draw (None = none)."""

    @model_validator(mode="after")
    def _fields_for_kind(self) -> Dist:
        if self.kind == "exponential" and self.value <= 0:
            raise ValueError(f"kind = 'exponential' needs value (the mean) > 0 (got {self.value})")
        if self.kind == "lognormal" and self.p50 <= 0:
            raise ValueError(f"kind = 'lognormal' needs p50 > 0 (got {self.p50})")
        if self.kind == "empirical" and not self.values:
            raise ValueError("kind = 'empirical' needs a non-empty `values` list")
        if self.kind == "sweep" and not self.path:
            raise ValueError("kind = 'sweep' needs `path` (a sweep's samples.csv)")
        if self.min is not None and self.max is not None and self.min > self.max:
            raise ValueError(f"min ({self.min}) > max ({self.max})")
        return self


def resolve_paths(dist: Dist, base_dir: Path) -> Dist:
    """The same Dist with a relative `path` made absolute against `base_dir`."""
    if dist.path and not Path(dist.path).is_absolute():
        return dist.model_copy(update={"path": str((base_dir / dist.path).resolve())})
    return dist


@lru_cache(maxsize=32)
def _read_sweep(path: str) -> dict[tuple[str, float], tuple[list[float], int]]:
    """(config_id, density) -> (successful latencies in file order, number of failures)."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"sweep samples file {path} does not exist")
    cells: dict[tuple[str, float], tuple[list[float], int]] = {}
    with p.open(newline="") as f:
        for row in csv.DictReader(f):
            key = (row["config_id"], round(float(row["density"]), 6))
            ok_vals, fails = cells.get(key, ([], 0))
            if row["ok"] == "1" and row["latency_s"]:
                ok_vals.append(float(row["latency_s"]))
            else:
                fails += 1
            cells[key] = (ok_vals, fails)
    if not cells:
        raise ValueError(f"sweep samples file {path} has no samples")
    return cells


def sweep_configs(path: str) -> list[str]:
    """Configuration ids in a sweep's samples.csv, in file order."""
    seen: list[str] = []
    for cid, _ in _read_sweep(path):
        if cid not in seen:
            seen.append(cid)
    return seen


def sweep_densities(path: str, config_id: str = "") -> list[float]:
    """Measured densities of one configuration (empty = the first), ascending."""
    cid = config_id or sweep_configs(path)[0]
    return sorted(d for c, d in _read_sweep(path) if c == cid)


def sweep_samples(path: str, config_id: str, density: float, failed_as_s: float) -> np.ndarray:
    """Latencies of the cell closest to `density` (raises if the configuration is absent)."""
    cells = _read_sweep(path)
    cid = config_id or sweep_configs(path)[0]
    dens = [d for c, d in cells if c == cid]
    if not dens:
        raise ValueError(
            f"sweep samples file {path} has no configuration {cid!r} (it has {sweep_configs(path)})"
        )
    best = min(dens, key=lambda d: abs(d - density))
    ok_vals, fails = cells[(cid, best)]
    vals = list(ok_vals) + ([failed_as_s] * fails if failed_as_s > 0 else [])
    if not vals:
        raise ValueError(f"sweep cell {cid} at density {best} has no usable samples")
    return np.asarray(vals, dtype=np.float64)


class Sampler:
    """Draws from a Dist with a numpy Generator. `draw(n)` returns float64 samples of shape [n]."""

    def __init__(self, dist: Dist, rng: np.random.Generator) -> None:
        self.dist = dist
        self.rng = rng
        self._pool: np.ndarray | None = None
        if dist.kind == "empirical":
            self._pool = np.asarray(dist.values, dtype=np.float64)
        elif dist.kind == "sweep":
            self._pool = sweep_samples(dist.path, dist.config_id, dist.density, dist.failed_as_s)
        self._sigma = math.log(dist.p99_over_p50) / Z99
        self._next = 0
        self._block: np.ndarray | None = None
        self._pos = 0

    def draw(self, n: int) -> np.ndarray:
        """n draws; random kinds come from a pre-drawn block (fewer numpy calls)."""
        d = self.dist
        if d.kind in ("fixed",) or (d.kind == "empirical" and d.order == "sequential"):
            return self._draw(n)
        if self._block is None or self._pos + n > len(self._block):
            self._block = self._draw(max(_BLOCK, n))
            self._pos = 0
        out = self._block[self._pos : self._pos + n]
        self._pos += n
        return out

    def _draw(self, n: int) -> np.ndarray:
        d = self.dist
        if d.kind == "fixed":
            x = np.full(n, d.value, dtype=np.float64)
        elif d.kind == "exponential":
            x = self.rng.exponential(d.value, n)
        elif d.kind == "lognormal":
            x = d.p50 * np.exp(self._sigma * self.rng.standard_normal(n))
        elif d.kind == "empirical" and d.order == "sequential":
            assert self._pool is not None
            ix = (self._next + np.arange(n)) % len(self._pool)
            self._next = int(ix[-1] + 1) if n else self._next
            x = self._pool[ix]
        else:
            assert self._pool is not None
            x = self._pool[self.rng.integers(0, len(self._pool), n)]
        x = x * d.scale + d.shift
        if d.min is not None or d.max is not None:
            x = np.clip(x, d.min, d.max)
        return x

    def draw_one(self) -> float:
        return float(self.draw(1)[0])


def dist_mean(dist: Dist) -> float:
    """Expected value of a Dist: exact for every kind, or an estimate from 200,000 draws (fixed
    seed) when `min` or `max` clips it."""
    if dist.min is not None or dist.max is not None:
        return float(Sampler(dist, np.random.default_rng(0)).draw(200_000).mean())
    if dist.kind in ("fixed", "exponential"):
        base = dist.value
    elif dist.kind == "lognormal":
        sigma = math.log(dist.p99_over_p50) / Z99
        base = dist.p50 * math.exp(sigma * sigma / 2)
    elif dist.kind == "empirical":
        base = float(np.mean(dist.values))
    else:
        base = float(np.mean(sweep_samples(dist.path, dist.config_id, dist.density,
                                           dist.failed_as_s)))  # fmt: skip
    return base * dist.scale + dist.shift
