"""A short real sweep with the process backend (the CI sweep), failures from real sandboxes, and
the report/compare commands on its run directory."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from slipstream.cli import main
from slipstream.config.sweep import SweepConfig
from slipstream.sweep.run import run_sweep

OUTPUTS = [
    "samples.csv",
    "aggregates.json",
    "provenance.json",
    "report.md",
    "latency_vs_density.png",
    "tail_ratio_vs_density.png",
    "amplification_vs_density.png",
]


def _rows(run_dir: Path) -> list[dict]:
    with open(run_dir / "samples.csv") as f:
        return list(csv.DictReader(f))


@pytest.fixture(scope="module")
def short_sweep(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cfg = SweepConfig(
        backends=["process"],
        pinnings=["none", "core"],
        densities=[0.5, 1.0, 2.0],
        repeats=2,
        iterations=2,
        min_samples_per_cell=0,
        workload="cpu-loop",
        workload_scale=0.05,
        noise_check_runs=3,
        bootstrap_resamples=50,
    )
    return run_sweep(cfg, tmp_path_factory.mktemp("sweep") / "run", show_progress=False)


def test_short_process_sweep_writes_every_output(short_sweep: Path) -> None:
    for name in OUTPUTS:
        assert (short_sweep / name).stat().st_size > 0, name
    prov = json.loads((short_sweep / "provenance.json").read_text())
    sweep = prov["sweep"]
    assert sweep["config"]["densities"] == [0.5, 1.0, 2.0]
    assert sweep["topology"]["num_cpus"] >= 1 and "bwrap" in sweep["backend_versions"]
    assert sweep["noise_check"]["runs"] == 3 and sweep["finished_utc"] >= sweep["started_utc"]
    assert prov["python"] and "git_commit" in prov
    nv = sweep["plan"]["num_vcpus"]
    rows = _rows(short_sweep)
    expected = (
        sum(max(1, round(d * nv)) for d in (0.5, 1.0, 2.0)) * 2 * 2 * 2
    )  # x pinnings x repeats x its
    assert len(rows) == expected
    assert all(r["ok"] == "1" for r in rows), [r["detail"] for r in rows if r["ok"] != "1"][:3]
    pinned = [r for r in rows if r["pinning"] == "core"]
    assert all(r["cpus"] for r in pinned)
    agg = json.loads((short_sweep / "aggregates.json").read_text())
    assert len(agg["cells"]) == 2 * 3
    assert {r["config_id"] for r in agg["recommendations"]} == {
        c["config_id"] for c in agg["cells"]
    }
    report = (short_sweep / "report.md").read_text()
    assert "## Recommendation" in report and "1.0x rule" in report


def test_report_command_rebuilds_identically(short_sweep: Path, capsys) -> None:
    before = {n: (short_sweep / n).read_bytes() for n in ("aggregates.json", "report.md")}
    (short_sweep / "aggregates.json").unlink()
    assert main(["sweep", "report", str(short_sweep)]) == 0
    for name, data in before.items():
        assert (short_sweep / name).read_bytes() == data, name
    assert "recommend" in capsys.readouterr().out
    assert main(["sweep", "compare", str(short_sweep), str(short_sweep)]) == 0
    assert "B/A p99" in capsys.readouterr().out


def test_failed_and_timed_out_sandboxes_are_samples(tmp_path: Path) -> None:
    common = dict(
        backends=["process"],
        pinnings=["none"],
        densities=[1.0],
        repeats=1,
        iterations=2,
        min_samples_per_cell=0,
        noise_check_runs=0,
        bootstrap_resamples=20,
    )
    failing = run_sweep(
        SweepConfig(workload_cmd="echo doomed >&2; exit 3", **common), tmp_path / "exit", False
    )
    slow = run_sweep(
        SweepConfig(workload_cmd="sleep 5", timeout_s=0.3, **common), tmp_path / "timeout", False
    )
    for run_dir, reason in ((failing, "exit"), (slow, "timeout")):
        rows = _rows(run_dir)
        nv = json.loads((run_dir / "provenance.json").read_text())["sweep"]["plan"]["num_vcpus"]
        assert len(rows) == nv * 2  # one per sandbox per iteration: none dropped
        assert {r["ok"] for r in rows} == {"0"} and {r["reason"] for r in rows} == {reason}
        cell = json.loads((run_dir / "aggregates.json").read_text())["cells"][0]
        assert cell["failures"] == {reason: nv * 2} and cell["n_ok"] == 0
        assert cell["groups"]["8"]["p_group_has_failure"] == 1.0
        rec = json.loads((run_dir / "aggregates.json").read_text())["recommendations"][0]
        assert rec["recommended"] is None
    assert "doomed" in _rows(failing)[0]["detail"]
    assert all(float(r["latency_s"]) < 3.0 for r in _rows(slow))


def _bwrap_works() -> str | None:
    """None if a bwrap sandbox starts here, else why not (the sweep itself would record every
    sample as a `create` failure, which is right for a sweep but not what this test checks)."""
    import asyncio

    from slipstream.sandbox.base import SandboxTemplate, make_backend
    from slipstream.sandbox.errors import SandboxError

    async def probe() -> None:
        backend = make_backend("bwrap")
        try:
            box = await backend.create(SandboxTemplate(backend="bwrap"), sandbox_id="sweep-probe")
            await box.release()
        finally:
            await backend.close()

    try:
        asyncio.run(probe())
    except SandboxError as e:
        return str(e)
    return None


def test_short_bwrap_sweep(tmp_path: Path) -> None:
    why = _bwrap_works()
    if why is not None:
        pytest.skip(f"bwrap sandboxes cannot start here: {why}")
    cfg = SweepConfig(
        backends=["bwrap"],
        pinnings=["core"],
        densities=[1.0],
        repeats=1,
        iterations=2,
        min_samples_per_cell=0,
        workload="verify",
        noise_check_runs=0,
        bootstrap_resamples=20,
    )
    run_dir = run_sweep(cfg, tmp_path / "bwrap", show_progress=False)
    rows = _rows(run_dir)
    assert rows and all(r["ok"] == "1" for r in rows), [r["detail"] for r in rows][:3]
    assert {r["backend"] for r in rows} == {"bwrap"}
