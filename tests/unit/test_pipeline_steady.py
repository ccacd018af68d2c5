"""bench pipeline's steady rate: trained samples per second after the first third of the steps,
from the controller's cumulative records, so async's pipeline fill does not count against it."""

from __future__ import annotations

import pytest

from slipstream.bench.pipeline import steady_samples_per_s


def records(step_times_s: list[float], samples_per_step: int = 64) -> list[dict[str, float]]:
    """Cumulative records as the controller writes them: samples_per_s = total / elapsed."""
    return [
        {"elapsed_s": t, "samples_total": samples_per_step * (i + 1),
         "samples_per_s": samples_per_step * (i + 1) / t}
        for i, t in enumerate(step_times_s)
    ]  # fmt: skip


def test_steady_rate_excludes_the_fill() -> None:
    # A 10-s fill before the first step, then one 64-sample step every 2 s: the whole-run rate
    # is 384 / 20 = 19.2 samples/s, the steady rate 32.
    recs = records([10, 12, 14, 16, 18, 20])
    assert recs[-1]["samples_per_s"] == pytest.approx(19.2)
    assert steady_samples_per_s(recs) == pytest.approx(32.0)


def test_steady_rate_measures_from_the_end_of_the_first_third() -> None:
    # 9 steps: measured from step 3 on; steps 1-3 are slow, 4-9 take 1 s each.
    recs = records([5, 10, 15, 16, 17, 18, 19, 20, 21])
    assert steady_samples_per_s(recs) == pytest.approx(64.0)


@pytest.mark.parametrize("times", [[], [1.0], [1.0, 2.0], [3.0, 3.0, 3.0]])
def test_no_steady_rate_without_a_window(times: list[float]) -> None:
    assert steady_samples_per_s(records(times)) is None
