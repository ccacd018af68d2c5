"""The FIFO server pool (verification threads / sandboxes) against M/M/c closed forms."""

from __future__ import annotations

import math

import numpy as np
import pytest

from slipstream.plan.fifo_servers import ServerPool


def erlang_c_wait(lam: float, mu: float, c: int) -> float:
    """Mean wait in queue of an M/M/c queue (Erlang C)."""
    a = lam / mu
    rho = a / c
    top = a**c / math.factorial(c) / (1 - rho)
    p_wait = top / (sum(a**k / math.factorial(k) for k in range(c)) + top)
    return p_wait / (c * mu - lam)


@pytest.mark.parametrize(("c", "rho"), [(1, 0.5), (4, 0.8), (16, 0.9)])
def test_mean_wait_matches_erlang_c(c: int, rho: float) -> None:
    rng = np.random.default_rng(c)
    mu = 1.0
    lam = rho * c * mu
    n = 200_000
    arrivals = np.cumsum(rng.exponential(1 / lam, n))
    services = rng.exponential(1 / mu, n)
    pool = ServerPool(c)
    for t, s in zip(arrivals.tolist(), services.tolist(), strict=True):
        pool.submit(t, [s])
    assert pool.wait_s / pool.num_jobs == pytest.approx(erlang_c_wait(lam, mu, c), rel=0.06)
    assert pool.busy_s / arrivals[-1] / c == pytest.approx(rho, rel=0.02)


def test_a_batch_ends_with_its_slowest_job_and_waits_for_free_servers() -> None:
    pool = ServerPool(2)
    # two servers: the third job waits for the first to end (1.0 s), the batch ends at 3.0
    assert pool.submit(0.0, [1.0, 3.0, 0.5]) == pytest.approx(3.0)
    assert pool.wait_s == pytest.approx(1.0)
    assert pool.submit(0.0, []) == 0.0
    with pytest.raises(ValueError, match="back in time"):
        pool.submit(-1.0, [1.0])
    with pytest.raises(ValueError, match="at least one"):
        ServerPool(0)
