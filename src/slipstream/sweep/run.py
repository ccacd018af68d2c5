"""`run_sweep`: topology -> plan -> noise check -> every cell (progress bar) -> run directory.

The run directory holds samples.csv (written after every cell, so an interrupted sweep keeps what
it measured), provenance.json (host, versions, topology, full config, plan, noise check,
timestamps) and, via `report.build_outputs`, aggregates.json, the plots and report.md.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import logging
import shutil
import subprocess
import time
from dataclasses import asdict
from pathlib import Path

from slipstream.config.sweep import SweepConfig
from slipstream.observe.provenance import collect_provenance
from slipstream.sandbox.host_topology import read_topology
from slipstream.sweep.matrix import Plan, build_plan, estimate_cell_s
from slipstream.sweep.report import PROVENANCE, SAMPLES, build_outputs
from slipstream.sweep.runner import noise_check, run_cell
from slipstream.sweep.samples import Sample, write_samples
from slipstream.sweep.workloads import Workload, build_workload

log = logging.getLogger(__name__)

VERSION_COMMANDS = {
    "bwrap": ["bwrap", "--version"],
    "qemu": ["qemu-system-x86_64", "--version"],
    "firecracker": ["firecracker", "--version"],
    "jailer": ["jailer", "--version"],
    "gcc": ["gcc", "--version"],
}


def backend_versions() -> dict[str, str | None]:
    """First line of `<tool> --version` for each sandbox-related tool; None when absent."""
    out: dict[str, str | None] = {}
    for name, argv in VERSION_COMMANDS.items():
        if shutil.which(argv[0]) is None:
            out[name] = None
            continue
        try:
            res = subprocess.run(argv, capture_output=True, text=True, timeout=10, check=False)
        except (OSError, subprocess.TimeoutExpired) as e:
            out[name] = f"error: {e}"
            continue
        text = (res.stdout or res.stderr).strip().splitlines()
        out[name] = text[0] if text else f"exit {res.returncode}"
    return out


def _meminfo() -> dict[str, int | None]:
    """MemTotal / MemAvailable in bytes from /proc/meminfo (None where absent)."""
    facts: dict[str, int | None] = {"mem_total_bytes": None, "mem_available_bytes": None}
    path = Path("/proc/meminfo")
    if path.is_file():
        for line in path.read_text().splitlines():
            key, _, rest = line.partition(":")
            if key in ("MemTotal", "MemAvailable"):
                name = "mem_total_bytes" if key == "MemTotal" else "mem_available_bytes"
                facts[name] = int(rest.split()[0]) * 1024
    return facts


def _now() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="seconds")


def default_run_dir() -> Path:
    return Path("benchmarks") / "sweeps" / dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")


def make_plan(cfg: SweepConfig) -> Plan:
    return build_plan(cfg, read_topology(cfg.sysfs_root))


def _provenance(cfg: SweepConfig, plan: Plan, workload: Workload, sweep_extra: dict) -> dict:
    return collect_provenance(
        {
            "sweep": {
                "config": cfg.model_dump(mode="json"),
                "plan": plan.to_dict(),
                "topology": plan.topology.to_dict(),
                "backend_versions": backend_versions(),
                "host_memory": _meminfo(),
                "workload": {
                    "name": workload.name,
                    "turns": [list(t) for t in workload.turns],
                    "think_s": workload.think_s,
                },
                **sweep_extra,
            }
        }
    )


def _loadavg_1m() -> float | None:
    path = Path("/proc/loadavg")
    return float(path.read_text().split()[0]) if path.is_file() else None


async def _run_cells(
    cfg: SweepConfig, plan: Plan, workload: Workload, run_dir: Path, progress, loads: list
):
    """Run every cell in plan order; `loads` collects the 1-minute load average before each."""
    from slipstream.sandbox.base import make_backend

    backends = {name: make_backend(name) for name in {c.backend for c in plan.configurations}}
    samples: list[Sample] = []
    t0 = time.perf_counter()
    try:
        for k, cell in enumerate(plan.cells):
            now = (
                f"{cell.config.id} d={cell.point.density:g} ({cell.point.num_sandboxes}) "
                f"r{cell.repeat}"
            )
            progress(f"cells {k}/{len(plan.cells)} done", 0.0, now)
            loads.append(_loadavg_1m())
            result = await run_cell(backends[cell.config.backend], cell, plan, cfg, workload, t0)
            samples.extend(result.samples)
            write_samples(run_dir / SAMPLES, samples)
            progress(
                f"cells {k + 1}/{len(plan.cells)} done",
                estimate_cell_s(cell, cfg, len(plan.vcpus)),
                now,
            )
    finally:
        for b in backends.values():
            await b.close()
    return samples


def run_sweep(
    cfg: SweepConfig, run_dir: str | Path | None = None, show_progress: bool = True
) -> Path:
    """Run the whole sweep and write the run directory; returns its path.

    Raises ValueError when nothing can run (every option refused) or when asked to run on a fake
    sysfs tree (that plans for another machine: use --dry-run).
    """
    if Path(cfg.sysfs_root).resolve() != Path("/sys"):
        raise ValueError(
            f"sysfs_root={cfg.sysfs_root} describes another machine; only --dry-run may use it"
        )
    plan = make_plan(cfg)
    if not plan.configurations:
        reasons = "; ".join(f"{n.option} {n.value}: {n.reason}" for n in plan.not_honoured)
        raise ValueError(f"no configuration of this sweep can run on this host ({reasons})")
    for n in plan.not_honoured:
        log.warning("sweep: %s %s not honoured: %s", n.option, n.value, n.reason)
    workload = build_workload(cfg)
    run_dir = Path(run_dir) if run_dir is not None else default_run_dir()
    run_dir.mkdir(parents=True, exist_ok=True)
    started = _now()
    t_start = time.perf_counter()
    noise = noise_check(cfg.noise_check_runs)
    if noise.get("cv", 0) > 0.10:
        log.warning(
            "sweep: idle-host noise check CV %.1f%%: tails will be inflated", noise["cv"] * 100
        )
    extra = {"started_utc": started, "noise_check": noise}
    # Provenance first, so even an interrupted run directory says what was attempted.
    (run_dir / PROVENANCE).write_text(json.dumps(_provenance(cfg, plan, workload, extra), indent=1))

    loads: list[float | None] = []
    if show_progress:
        from rich.progress import (
            BarColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )
        from rich.table import Column

        bar = Progress(
            TextColumn("{task.description}"),
            BarColumn(bar_width=20),
            TextColumn("elapsed"),
            TimeElapsedColumn(),
            TextColumn("left ~"),
            TimeRemainingColumn(),
            TextColumn(
                "{task.fields[now]}",
                table_column=Column(no_wrap=True, overflow="ellipsis", max_width=40),
            ),
        )
        total = sum(estimate_cell_s(c, cfg, len(plan.vcpus)) for c in plan.cells)
        task = bar.add_task("sweep", total=total, now="")

        def progress(desc: str, advance: float, now: str) -> None:
            bar.update(task, description=desc, advance=advance, now=now)

        with bar:
            asyncio.run(_run_cells(cfg, plan, workload, run_dir, progress, loads))
    else:
        asyncio.run(_run_cells(cfg, plan, workload, run_dir, lambda desc, adv, now: None, loads))

    extra.update(
        finished_utc=_now(),
        wall_s=round(time.perf_counter() - t_start, 3),
        loadavg_1m_per_cell=loads,
    )
    (run_dir / PROVENANCE).write_text(json.dumps(_provenance(cfg, plan, workload, extra), indent=1))
    build_outputs(run_dir)
    return run_dir


def plan_summary(plan: Plan) -> dict:
    return {**plan.to_dict(), "configurations": [asdict(c) for c in plan.configurations]}
