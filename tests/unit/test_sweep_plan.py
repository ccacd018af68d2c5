"""Sweep plan and CPU/memory assignment on the fake sysfs tree (2 NUMA nodes, SMT, 4 L3 domains)
and on this host; options the host cannot honour are reported."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from slipstream.cli import main
from slipstream.config.sweep import SweepConfig
from slipstream.sandbox.host_topology import read_topology
from slipstream.sweep.matrix import build_plan, density_points, format_plan
from slipstream.sweep.run import run_sweep
from slipstream.sweep.runner import assign, pinning_units

FIXTURE = str(Path(__file__).resolve().parents[1] / "data" / "sysfs_2numa_smt_4l3")


def _cfg(**kw) -> SweepConfig:
    base = dict(backends=["process"], sysfs_root=FIXTURE, pinnings=["none", "core", "thread", "l3"])
    return SweepConfig(**{**base, **kw})


def test_plan_on_fixture_has_full_matrix() -> None:
    cfg = _cfg(
        densities=[0.25, 0.5, 1.0, 1.15, 2.0], repeats=3, iterations=2, min_samples_per_cell=0
    )
    plan = build_plan(cfg, read_topology(FIXTURE))
    ids = [c.id for c in plan.configurations]
    assert len(ids) == 4 * 2  # 4 pinnings x {local, interleave}, SMT as found (on)
    assert "process/l3/interleave/smt-on" in ids
    assert [p.num_sandboxes for p in plan.points] == [4, 8, 16, 18, 32]
    assert len(plan.cells) == 8 * 5 * 3
    # Repeat-major order: every configuration and density of repeat 0 before any of repeat 1.
    assert [c.repeat for c in plan.cells[:40]] == [0] * 40
    assert plan.not_honoured == []
    assert plan.to_dict()["num_samples"] == 8 * 3 * 2 * (4 + 8 + 16 + 18 + 32)
    assert plan.estimated_s > 0
    text = format_plan(plan, cfg)
    assert "2 NUMA node(s), 4 L3 domain(s)" in text and "SMT on" in text
    assert "estimated duration" in text


def test_min_samples_raise_iterations_at_low_density() -> None:
    points, notes = density_points(
        [0.5, 1.0, 1.15, 2.0], num_vcpus=2, iterations=3, min_samples=160, repeats=2
    )
    assert [(p.num_sandboxes, p.iterations) for p in points] == [(1, 80), (2, 40), (2, 40), (4, 20)]
    assert len(notes) == 1 and "1.15" in notes[0]  # 1.15 x 2 vCPUs = 2 sandboxes, same as 1.0


def test_unhonourable_options_are_reported(tmp_path: Path) -> None:
    root = tmp_path / "sys"
    shutil.copytree(FIXTURE, root)
    shutil.rmtree(root / "devices/system/node/node1")  # one NUMA node left
    (root / "devices/system/cpu/smt/control").write_text("notsupported\n")
    for cpu in range(16):
        for idx in (root / f"devices/system/cpu/cpu{cpu}/cache").glob("index3"):
            shutil.rmtree(idx)
    cfg = _cfg(sysfs_root=str(root), smt=["as-found", "off"], backends=["process", "firecracker"])
    plan = build_plan(cfg, read_topology(root))
    refused = {(n.option, n.value): n.reason for n in plan.not_honoured}
    assert "nothing to interleave" in refused[("memory", "interleave")]
    assert "cannot be switched" in refused[("smt", "off")]
    assert "no L3 cache information" in refused[("pinning", "process/l3")]
    if shutil.which("firecracker") is None:
        assert "not found" in refused[("backend", "firecracker")]
    assert {c.pinning for c in plan.configurations} == {"none", "core", "thread"}
    text = format_plan(plan, cfg)
    assert "NOT HONOURED" in text and "memory interleave" in text and "smt off" in text


def test_this_host_plan_reports_interleave_on_one_node() -> None:
    topo = read_topology()
    cfg = SweepConfig(backends=["process"])
    plan = build_plan(cfg, topo)
    if topo.num_numa_nodes == 1:
        assert any(n.option == "memory" and n.value == "interleave" for n in plan.not_honoured)
    assert plan.configurations


def test_assignment_on_fixture() -> None:
    topo = read_topology(FIXTURE)
    vcpus = topo.online_cpus
    assert pinning_units("core", topo, vcpus)[:2] == [(0, 8), (1, 9)]
    threads = pinning_units("thread", topo, vcpus)
    assert threads[:8] == [(c,) for c in range(8)] and threads[8] == (8,)  # siblings last
    assert pinning_units("l3", topo, vcpus) == [
        (0, 1, 8, 9),
        (2, 3, 10, 11),
        (4, 5, 12, 13),
        (6, 7, 14, 15),
    ]
    core = assign("core", "local", topo, vcpus, 10)
    assert core[0] == ((0, 8), (0,)) and core[5] == ((5, 13), (1,))
    assert core[8] == ((0, 8), (0,))  # density > 1 core per sandbox: round-robin sharing
    assert assign("l3", "interleave", topo, vcpus, 2)[1] == ((2, 3, 10, 11), (0, 1))
    assert assign("none", "local", topo, vcpus, 3) == [(None, None)] * 3
    assert assign("none", "interleave", topo, vcpus, 1) == [(None, (0, 1))]


def test_dry_run_cli_on_fixture(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(
        [
            "sweep",
            "run",
            "--dry-run",
            "--sysfs-root",
            FIXTURE,
            "--backends",
            "process",
            "--pinnings",
            "none,core,thread,l3",
            "--smt",
            "as-found,off",
            "--densities",
            "0.5,1,2",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0
    assert "configurations (8)" in out
    assert "process/thread/interleave/smt-on" in out
    assert "NOT HONOURED" in out and "smt off" in out
    assert "estimated duration" in out


def test_run_refuses_fake_sysfs() -> None:
    with pytest.raises(ValueError, match="only --dry-run"):
        run_sweep(_cfg(), "/nonexistent-run-dir", show_progress=False)


def test_bad_config_is_named() -> None:
    with pytest.raises(ValueError, match="recommend_g"):
        SweepConfig(group_sizes=[8], recommend_g=16)
    with pytest.raises(ValueError, match="densities"):
        SweepConfig(densities=[0.5, -1])
