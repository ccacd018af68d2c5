"""Sweep statistics against hand-computed values and known distributions."""

from __future__ import annotations

import math

import numpy as np
import pytest

from slipstream.sweep.stats import (
    amplification,
    bootstrap_amplification,
    distribution_stats,
    expected_max_of_g,
    group_stats,
    max_of_g_weights,
    spread,
)


def test_percentiles_and_moments_by_hand() -> None:
    # 1..10 shuffled; numpy linear interpolation: rank = 1 + 9 p / 100.
    x = np.array([7, 3, 10, 1, 5, 9, 2, 8, 6, 4], dtype=float)
    s = distribution_stats(x)
    assert s["n"] == 10
    assert s["min"] == 1 and s["max"] == 10
    assert s["p50"] == pytest.approx(5.5)
    assert s["p90"] == pytest.approx(9.1)
    assert s["p95"] == pytest.approx(9.55)
    assert s["p99"] == pytest.approx(9.91)
    assert s["p99_9"] == pytest.approx(9.991)
    assert s["mean"] == pytest.approx(5.5)
    assert s["stdev"] == pytest.approx(math.sqrt(82.5 / 9), rel=1e-5)
    assert s["cv"] == pytest.approx(math.sqrt(82.5 / 9) / 5.5, rel=1e-5)
    assert s["p99_p50"] == pytest.approx(9.91 / 5.5, rel=1e-5)


def test_empty_and_single_sample() -> None:
    assert distribution_stats(np.array([]))["p50"] is None
    one = distribution_stats(np.array([0.25]))
    assert one["n"] == 1 and one["p99"] == 0.25 and one["stdev"] == 0.0 and one["p99_p50"] == 1.0


def test_expected_max_by_hand() -> None:
    # Two draws from {1, 2, 3}: P(max=1)=1/9, P(max=2)=3/9, P(max=3)=5/9 -> E = 22/9.
    assert expected_max_of_g(np.array([3.0, 1.0, 2.0]), 2) == pytest.approx(22 / 9)
    assert max_of_g_weights(3, 2) == pytest.approx([1 / 9, 3 / 9, 5 / 9])
    assert max_of_g_weights(1000, 64).sum() == pytest.approx(1.0)
    # G = 1 is the mean; a constant sample has amplification exactly 1.
    assert expected_max_of_g(np.array([1.0, 2.0, 6.0]), 1) == pytest.approx(3.0)
    assert amplification(np.full(50, 0.2), 64) == pytest.approx(1.0)


@pytest.mark.parametrize("g", [8, 16, 64])
def test_amplification_of_exponential_latencies(g: int) -> None:
    # Exp(1): E[max of G] = H_G (G-th harmonic number), median = ln 2. Use exact quantiles of the
    # distribution as the sample, so the only error is the discretisation (n = 200k).
    n = 200_000
    x = -np.log1p(-(np.arange(1, n + 1) - 0.5) / n)
    harmonic = sum(1.0 / k for k in range(1, g + 1))
    assert expected_max_of_g(x, g) == pytest.approx(harmonic, rel=2e-3)
    assert amplification(x, g) == pytest.approx(harmonic / math.log(2), rel=2e-3)


def test_bootstrap_ci_covers_the_true_amplification() -> None:
    rng = np.random.default_rng(1)
    x = rng.exponential(0.1, size=3000)
    cis = bootstrap_amplification(x, [8, 64], resamples=300, seed=0)
    for g, (lo, hi) in cis.items():
        truth = sum(1.0 / k for k in range(1, g + 1)) / math.log(2)
        assert lo < amplification(x, g) < hi
        assert lo < truth < hi
    # Deterministic for a fixed seed (a rebuilt report must be identical).
    assert bootstrap_amplification(x, [8], 50, seed=3) == bootstrap_amplification(
        x, [8], 50, seed=3
    )


def test_group_stats_probabilities_and_small_sample_warning() -> None:
    x = np.linspace(1.0, 2.0, 100)
    out = group_stats(x, num_failures=10, group_sizes=[8, 16], resamples=50, seed=0)
    assert out["8"]["p_group_has_p99_event"] == pytest.approx(1 - 0.99**8, rel=1e-5)
    assert out["16"]["p_group_has_failure"] == pytest.approx(1 - 0.9**16, rel=1e-5)
    assert out["8"]["warning"] is None  # 100 >= 80
    assert "160" in out["16"]["warning"]
    assert group_stats(x, 0, [64], 20, 0)["64"]["p_group_has_p99_event"] == pytest.approx(
        0.474, abs=1e-3
    )  # the seed's "~47% of gradient steps"


def test_spread_across_repeats() -> None:
    s = spread([1.0, 1.2, 0.8])
    assert s["n"] == 3 and s["min"] == 0.8 and s["max"] == 1.2
    assert s["rel_range"] == pytest.approx(0.4)
    assert spread([])["n"] == 0
