"""Latency statistics for one sweep cell: percentiles, spread, and GRPO group amplification.

Amplification for a group of G rollouts is E[max of G latencies] / p50: every gradient step waits
for the slowest rollout of its group. E[max of G] is computed exactly from the empirical
distribution (G draws with replacement): with sorted samples x_(1) <= ... <= x_(n),
P(max <= x_(i)) = (i/n)^G, so E[max] = sum_i x_(i) * ((i/n)^G - ((i-1)/n)^G).
Its 95% confidence interval is a percentile bootstrap over the samples (fixed RNG seed, so a
report rebuilt from the same samples is identical).

Percentiles use numpy's default linear interpolation (type 7): p-th percentile of n sorted samples
is x at rank 1 + (n-1)p/100, interpolated. Not covered: weighting by repeat, censoring models for
timeouts (a timeout is simply counted at the timeout value in the failures-included statistics).
"""

from __future__ import annotations

import math

import numpy as np

PERCENTILES = {"p50": 50.0, "p90": 90.0, "p95": 95.0, "p99": 99.0, "p99_9": 99.9}


def round_significant(x: float, digits: int = 6) -> float | None:
    """Round to `digits` significant digits for stable JSON; NaN/inf -> None."""
    if x is None or not math.isfinite(x):
        return None
    if x == 0:
        return 0.0
    return float(f"{x:.{digits}g}")


def distribution_stats(x_s: np.ndarray) -> dict[str, float | int | None]:
    """n, min, p50, p90, p95, p99, p99.9, max, mean, stdev (ddof=1), CV and p99/p50 of `x_s`.

    An empty input gives n=0 and None everywhere else.
    """
    x = np.asarray(x_s, dtype=np.float64)
    keys = ["min", *PERCENTILES, "max", "mean", "stdev", "cv", "p99_p50"]
    if x.size == 0:
        return {"n": 0, **{k: None for k in keys}}
    pct = np.percentile(x, list(PERCENTILES.values()))
    mean = float(x.mean())
    stdev = float(x.std(ddof=1)) if x.size > 1 else 0.0
    out: dict[str, float | int | None] = {
        "n": int(x.size),
        "min": round_significant(float(x.min())),
    }
    out.update({k: round_significant(float(v)) for k, v in zip(PERCENTILES, pct, strict=True)})
    out["max"] = round_significant(float(x.max()))
    out["mean"] = round_significant(mean)
    out["stdev"] = round_significant(stdev)
    out["cv"] = round_significant(stdev / mean) if mean > 0 else None
    out["p99_p50"] = round_significant(float(pct[3] / pct[0])) if pct[0] > 0 else None
    return out


def max_of_g_weights(n: int, g: int) -> np.ndarray:
    """Weights w_i = (i/n)^G - ((i-1)/n)^G, i = 1..n: P(the max of G draws is the i-th smallest)."""
    cdf = (np.arange(0, n + 1, dtype=np.float64) / n) ** g
    return np.diff(cdf)


def expected_max_of_g(x_s: np.ndarray, g: int) -> float:
    """Exact E[max of G draws with replacement] from the empirical distribution of `x_s`."""
    x = np.sort(np.asarray(x_s, dtype=np.float64))
    if x.size == 0:
        return math.nan
    return float(x @ max_of_g_weights(x.size, g))


def amplification(x_s: np.ndarray, g: int) -> float:
    """E[max of G] / p50. NaN for an empty sample or a zero median."""
    x = np.asarray(x_s, dtype=np.float64)
    if x.size == 0:
        return math.nan
    med = float(np.median(x))
    return expected_max_of_g(x, g) / med if med > 0 else math.nan


def bootstrap_amplification(
    x_s: np.ndarray, group_sizes: list[int], resamples: int, seed: int
) -> dict[int, tuple[float, float]]:
    """95% percentile-bootstrap CI of the amplification for each G (same resamples for every G)."""
    x = np.asarray(x_s, dtype=np.float64)
    n = x.size
    if n < 2:
        return {g: (math.nan, math.nan) for g in group_sizes}
    rng = np.random.default_rng(seed)
    weights = np.stack([max_of_g_weights(n, g) for g in group_sizes], axis=1)  # (n, num_G)
    amps = np.empty((resamples, len(group_sizes)))
    chunk = max(1, int(4_000_000 // n))  # bound memory at ~32 MB of float64 per chunk
    for start in range(0, resamples, chunk):
        stop = min(resamples, start + chunk)
        draws = np.sort(x[rng.integers(0, n, size=(stop - start, n))], axis=1)
        medians = np.median(draws, axis=1)
        with np.errstate(divide="ignore", invalid="ignore"):
            amps[start:stop] = (draws @ weights) / medians[:, None]
    out = {}
    for j, g in enumerate(group_sizes):
        col = amps[:, j][np.isfinite(amps[:, j])]
        if col.size == 0:
            out[g] = (math.nan, math.nan)
        else:
            lo, hi = np.percentile(col, [2.5, 97.5])
            out[g] = (float(lo), float(hi))
    return out


def group_stats(
    x_s: np.ndarray,
    num_failures: int,
    group_sizes: list[int],
    resamples: int,
    seed: int,
) -> dict[str, dict]:
    """Per G: amplification with bootstrap CI and a small-sample warning, P(group has a p99 event),
    P(group has a failure). `x_s` is the latency sample the amplification is computed over."""
    x = np.asarray(x_s, dtype=np.float64)
    n_total = x.size
    fail_rate = num_failures / n_total if n_total else 0.0
    cis = bootstrap_amplification(x, group_sizes, resamples, seed)
    out: dict[str, dict] = {}
    for g in group_sizes:
        warning = None
        if n_total < 10 * g:
            warning = f"{n_total} samples < 10*G = {10 * g}: the max of G is poorly estimated"
        out[str(g)] = {
            "amplification": round_significant(amplification(x, g)),
            "ci95": [round_significant(cis[g][0]), round_significant(cis[g][1])],
            "expected_max_s": round_significant(expected_max_of_g(x, g)),
            "p_group_has_p99_event": round_significant(1.0 - 0.99**g),
            "p_group_has_failure": round_significant(1.0 - (1.0 - fail_rate) ** g),
            "warning": warning,
        }
    return out


def spread(values: list[float]) -> dict[str, float | int | None]:
    """Spread of one statistic across repeats: n, min, max, mean, stdev, (max-min)/mean."""
    v = np.asarray([x for x in values if x is not None and math.isfinite(x)], dtype=np.float64)
    if v.size == 0:
        return {"n": 0, "min": None, "max": None, "mean": None, "stdev": None, "rel_range": None}
    mean = float(v.mean())
    return {
        "n": int(v.size),
        "min": round_significant(float(v.min())),
        "max": round_significant(float(v.max())),
        "mean": round_significant(mean),
        "stdev": round_significant(float(v.std(ddof=1)) if v.size > 1 else 0.0),
        "rel_range": round_significant(float((v.max() - v.min()) / mean)) if mean > 0 else None,
    }
