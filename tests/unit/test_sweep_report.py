"""Aggregation, failures kept and counted, recommendation, and byte-identical rebuilds from
samples.csv (synthetic samples; the real-sandbox path is in tests/integration/test_sweep_process.py)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from slipstream.config.sweep import SweepConfig
from slipstream.sweep.aggregate import aggregate
from slipstream.sweep.report import build_outputs, compare_runs
from slipstream.sweep.samples import Sample, read_samples, write_samples

NUM_VCPUS = 4


def _samples(seed: int = 0, tail_from: float = 1.5, fail_at: float = 2.0) -> list[Sample]:
    """Two configs x densities 0.5..2 on 4 vCPUs; above `tail_from` the tail grows; at `fail_at`
    two samples per repeat fail (one timeout, one exit)."""
    rng = np.random.default_rng(seed)
    out = []
    for config in ("process/none/local/smt-off", "process/core/local/smt-off"):
        backend, pinning, memory, smt = config.split("/")
        for density in (0.5, 1.0, 1.5, 2.0):
            n = round(density * NUM_VCPUS)
            for repeat in range(2):
                t = 0.0
                for it in range(40 // n + 1):
                    for sb in range(n):
                        lat = 0.1 + rng.exponential(0.01)
                        if density >= tail_from and pinning == "none":
                            lat += rng.exponential(0.08)
                        ok, reason, detail = True, "", ""
                        if density >= fail_at and it == 0 and sb < 2:
                            ok = False
                            reason, detail = (
                                ("timeout", "turn 0 timed out")
                                if sb == 0
                                else ("exit", "turn 0 exit 3: boom")
                            )
                        out.append(
                            Sample(
                                config,
                                backend,
                                pinning,
                                memory,
                                smt.removeprefix("smt-"),
                                density,
                                n,
                                repeat,
                                it,
                                sb,
                                "" if pinning == "none" else str(sb),
                                ok,
                                reason,
                                detail,
                                t,
                                lat,
                            )
                        )
                    t += 0.3
    return out


CFG = SweepConfig(backends=["process"], timeout_s=1.0, bootstrap_resamples=50).model_dump(
    mode="json"
)


def test_failures_are_kept_and_counted() -> None:
    agg = aggregate(_samples(), CFG, NUM_VCPUS)
    cell = next(c for c in agg["cells"] if c["pinning"] == "none" and c["density"] == 2.0)
    # 8 sandboxes x 6 iterations x 2 repeats, 2 failures per repeat.
    assert cell["n"] == 8 * 6 * 2
    assert cell["failures"] == {"exit": 2, "timeout": 2}
    assert cell["n_ok"] == cell["n"] - 4
    assert cell["fail_rate"] == pytest.approx(4 / 96, rel=1e-5)
    assert cell["successes"]["n"] == 92
    assert cell["with_failures_at_timeout"]["n"] == 96
    assert cell["with_failures_at_timeout"]["max"] == 1.0  # failures counted at the 1 s timeout
    assert cell["groups"]["16"]["p_group_has_failure"] == pytest.approx(
        1 - (1 - 4 / 96) ** 16, rel=1e-5
    )
    assert any("boom" in e for e in cell["failure_examples"])
    assert agg["num_failures"] == 8  # both configurations


def test_recommendation_finds_the_cliff() -> None:
    agg = aggregate(_samples(), CFG, NUM_VCPUS)
    recs = {r["config_id"]: r for r in agg["recommendations"]}
    none = recs["process/none/local/smt-off"]
    assert none["recommended"]["density"] == 1.0
    assert none["recommended"]["num_sandboxes"] == 4
    assert none["first_exceeding_density"] == 1.5
    assert none["agrees_with_1x_rule"] is True
    core = recs["process/core/local/smt-off"]
    # Pinned: no tail growth, but the failures at 2.0 (counted at the timeout) break the group.
    assert core["recommended"]["density"] == 1.5
    assert core["first_exceeding_density"] == 2.0
    assert core["agrees_with_1x_rule"] is False and "looser" in core["verdict"]


def test_recommendation_tighter_than_rule() -> None:
    agg = aggregate(_samples(tail_from=1.0, fail_at=9), CFG, NUM_VCPUS)
    rec = agg["recommendations"][0]
    assert rec["recommended"]["density"] == 0.5
    assert rec["agrees_with_1x_rule"] is False and "tighter" in rec["verdict"]


def _write_run(run_dir: Path, samples: list[Sample]) -> None:
    run_dir.mkdir()
    write_samples(run_dir / "samples.csv", samples)
    prov = {
        "hostname": "test",
        "cpu_model": "fake",
        "sweep": {
            "config": CFG,
            "plan": {
                "num_vcpus": NUM_VCPUS,
                "vcpus": "0-3",
                "not_honoured": [
                    {
                        "option": "memory",
                        "value": "interleave",
                        "reason": "1 NUMA node: nothing to interleave",
                    }
                ],
                "notes": ["a note"],
            },
            "topology": {
                "num_cores": 4,
                "threads_per_core": 1,
                "smt_active": False,
                "numa_nodes": {"0": {"cpus": "0-3", "mem_total_bytes": 2**33}},
                "l3_domains": ["0-3"],
            },
            "workload": {"name": "cpu-loop"},
            "noise_check": {"runs": 3, "p50_s": 0.01, "cv": 0.01, "verdict": "quiet"},
        },
    }
    (run_dir / "provenance.json").write_text(json.dumps(prov))


def test_report_rebuilds_identically_from_samples(tmp_path: Path) -> None:
    run = tmp_path / "run"
    samples = _samples()
    _write_run(run, samples)
    # Round trip through the CSV keeps every row, failures included.
    back = read_samples(run / "samples.csv")
    assert len(back) == len(samples)
    assert sum(not s.ok for s in back) == 8
    assert math.isclose(back[5].latency_s, samples[5].latency_s, abs_tol=1e-6)
    build_outputs(run, plots=True)
    first = {name: (run / name).read_bytes() for name in ("aggregates.json", "report.md")}
    for png in (
        "latency_vs_density.png",
        "tail_ratio_vs_density.png",
        "amplification_vs_density.png",
    ):
        assert (run / png).stat().st_size > 1000
    (run / "aggregates.json").unlink()
    (run / "report.md").write_text("stale")
    build_outputs(run, plots=False)
    for name, data in first.items():
        assert (run / name).read_bytes() == data, name
    report = first["report.md"].decode()
    assert "interleave" in report and "not honoured" in report
    assert "exit 2, timeout 2" in report


def test_compare_two_runs(tmp_path: Path) -> None:
    _write_run(tmp_path / "a", _samples(seed=0))
    _write_run(tmp_path / "b", _samples(seed=1, tail_from=1.0))
    build_outputs(tmp_path / "a", plots=False)
    build_outputs(tmp_path / "b", plots=False)
    text = compare_runs(tmp_path / "a", tmp_path / "b")
    assert "process/none/local/smt-off | 1.5" in text
    assert text.count("recommended") == 4
    with pytest.raises(FileNotFoundError, match="aggregates.json"):
        compare_runs(tmp_path / "a", tmp_path / "missing")
