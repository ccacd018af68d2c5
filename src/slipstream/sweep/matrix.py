"""Sweep plan: the configuration matrix crossed with densities and repeats, checked against the host.

A configuration is (backend, pinning, memory placement, SMT state). `build_plan` keeps every
requested option the host can honour and lists every one it cannot, with the reason, in
`Plan.not_honoured` (printed by `--dry-run` and written into the report): nothing is skipped
silently. Cells run repeat-major (all configurations and densities of repeat 0, then repeat 1, ...)
so slow drift of the host spreads over every cell instead of biasing the last configuration.

Not covered: switching SMT itself (see `smt_switch_allowed`, which only says whether it could be).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

from slipstream.config.sweep import SweepConfig
from slipstream.sandbox.host_topology import Topology, format_cpulist

# Rough single-sandbox costs (s) used only for the --dry-run duration estimate. Creation: measured
# on the dev machines (bwrap ~4 ms spawn, qemu TCG boot ~2 s); workloads: one idle vCPU.
CREATE_S = {"process": 0.08, "bwrap": 0.15, "qemu": 2.5, "firecracker": 0.3}
WORKLOAD_S = {"cpu-loop": 0.15, "verify": 0.12, "build": 0.3, "io": 0.15, "episode": 0.1}
BACKEND_BINARIES = {"bwrap": "bwrap", "qemu": "qemu-system-x86_64", "firecracker": "firecracker"}


@dataclass(frozen=True)
class Configuration:
    backend: str
    pinning: str
    memory: str
    smt: str  # "on" / "off": the state this configuration runs under

    @property
    def id(self) -> str:
        return f"{self.backend}/{self.pinning}/{self.memory}/smt-{self.smt}"


@dataclass(frozen=True)
class DensityPoint:
    density: float  # requested sandboxes per vCPU
    num_sandboxes: int
    effective_density: float  # num_sandboxes / vCPUs, what actually ran
    iterations: int  # per sandbox per repeat


@dataclass(frozen=True)
class Cell:
    config: Configuration
    point: DensityPoint
    repeat: int


@dataclass(frozen=True)
class NotHonoured:
    option: str
    value: str
    reason: str


@dataclass
class Plan:
    topology: Topology
    vcpus: tuple[int, ...]
    configurations: list[Configuration]
    points: list[DensityPoint]
    repeats: int
    iterations: int
    cells: list[Cell]
    not_honoured: list[NotHonoured] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    estimated_s: float = 0.0

    def to_dict(self) -> dict:
        return {
            "vcpus": format_cpulist(self.vcpus),
            "num_vcpus": len(self.vcpus),
            "configurations": [c.id for c in self.configurations],
            "densities": [asdict(p) for p in self.points],
            "repeats": self.repeats,
            "iterations": self.iterations,
            "num_cells": len(self.cells),
            "num_samples": sum(c.point.num_sandboxes * c.point.iterations for c in self.cells),
            "not_honoured": [asdict(n) for n in self.not_honoured],
            "notes": list(self.notes),
            "estimated_s": round(self.estimated_s, 1),
        }


def smt_switch_allowed(sysfs_root: str | Path) -> tuple[bool, str]:
    """Whether SMT could be switched here: smt/control must exist, be on/off and be writable."""
    control = Path(sysfs_root) / "devices/system/cpu/smt/control"
    if not control.exists():
        return False, f"{control} does not exist"
    state = control.read_text().strip()
    if state not in ("on", "off"):
        return False, f"{control} is {state!r} (SMT cannot be switched on this CPU/kernel)"
    if not os.access(control, os.W_OK):
        return False, f"{control} is not writable (needs root)"
    return True, f"{control} is {state!r} and writable"


def backend_available(name: str) -> tuple[bool, str]:
    """Cheap availability check for planning; the run itself reports the backend's own error."""
    if name == "process":
        return True, "always available (development only, isolates nothing)"
    binary = BACKEND_BINARIES[name]
    path = shutil.which(binary)
    if path is None:
        return False, f"`{binary}` not found on PATH"
    if name == "firecracker" and shutil.which("jailer") is None:
        return False, "`jailer` not found on PATH"
    return True, path


def sweep_vcpus(topo: Topology, sysfs_root: str | Path) -> tuple[int, ...]:
    """vCPUs the sweep may use: the online CPUs, restricted to this process's affinity on the
    real host (a fake tree describes another machine, so affinity does not apply)."""
    if Path(sysfs_root).resolve() == Path("/sys"):
        allowed = os.sched_getaffinity(0)
        cpus = tuple(c for c in topo.online_cpus if c in allowed)
        return cpus or topo.online_cpus
    return topo.online_cpus


def density_points(
    densities: list[float],
    num_vcpus: int,
    iterations: int = 1,
    min_samples: int = 0,
    repeats: int = 1,
) -> tuple[list[DensityPoint], list[str]]:
    """Round each density to a sandbox count and give it enough iterations per repeat for
    `min_samples` per cell (at least `iterations`); report densities that collapse to one count."""
    points: list[DensityPoint] = []
    notes: list[str] = []
    seen: dict[int, float] = {}
    for d in densities:
        n = max(1, round(d * num_vcpus))
        if n in seen:
            notes.append(
                f"density {d:g} gives {n} sandboxes on {num_vcpus} vCPUs, the same as density "
                f"{seen[n]:g}; it is kept, but measures the same load"
            )
        seen.setdefault(n, d)
        its = max(iterations, -(-min_samples // (n * repeats)))
        points.append(DensityPoint(d, n, n / num_vcpus, its))
    return points, notes


def _check_pinning(
    pinning: str, backend_pins: bool, topo: Topology, backend: str
) -> tuple[str | None, str | None]:
    """(reason it cannot be honoured, or None; a note when honoured but degenerate, or None)."""
    if pinning == "none":
        return None, None
    if not backend_pins:
        return f"backend {backend} cannot pin CPUs", None
    if pinning == "l3":
        if not topo.l3_domains:
            return "no L3 cache information in sysfs", None
        if len(topo.l3_domains) == 1:
            return None, "l3: one L3 domain covers every CPU, so `l3` pinning equals `none` here"
    if pinning == "thread" and not topo.smt_active:
        return None, "thread: SMT is off, so `thread` pinning equals `core` here"
    return None, None


def build_plan(cfg: SweepConfig, topo: Topology, pinning_backends: set[str] | None = None) -> Plan:
    """The matrix of honourable configurations x densities x repeats, plus what was refused.

    `pinning_backends`: backends able to pin CPUs and place memory (default: all but firecracker,
    whose jailer takes cpusets the sweep does not drive yet).
    """
    if pinning_backends is None:
        pinning_backends = {"process", "bwrap", "qemu"}
    vcpus = sweep_vcpus(topo, cfg.sysfs_root)
    not_honoured: list[NotHonoured] = []
    notes: list[str] = []

    backends = []
    for b in cfg.backends:
        ok, why = backend_available(b)
        if ok:
            backends.append(b)
        else:
            not_honoured.append(NotHonoured("backend", b, why))

    found_smt = "on" if topo.smt_active else "off"
    smt_states = []
    for s in cfg.smt:
        state = found_smt if s == "as-found" else s
        if state != found_smt:
            allowed, why = smt_switch_allowed(cfg.sysfs_root)
            reason = (
                "slipstream sweep does not switch SMT itself; run the sweep after "
                f"`echo {state} > /sys/devices/system/cpu/smt/control` ({why})"
                if allowed
                else f"SMT is {found_smt} and cannot be switched: {why}"
            )
            not_honoured.append(NotHonoured("smt", s, reason))
            continue
        if state not in smt_states:
            smt_states.append(state)
    notes.append(
        f"SMT is {found_smt} (from {topo.smt_source}; control={topo.smt_control}); "
        f"{topo.num_cores} cores x {topo.threads_per_core} threads"
    )

    memories = []
    for m in cfg.memory_placements:
        if m == "interleave" and topo.num_numa_nodes < 2:
            not_honoured.append(
                NotHonoured("memory", m, f"{topo.num_numa_nodes} NUMA node: nothing to interleave")
            )
            continue
        memories.append(m)
    if "local" in memories and topo.num_numa_nodes < 2:
        notes.append("memory local: one NUMA node, so every placement is local here")

    configs: list[Configuration] = []
    refused_pinning: set[tuple[str, str]] = set()
    for backend in backends:
        for pinning in cfg.pinnings:
            reason, note = _check_pinning(pinning, backend in pinning_backends, topo, backend)
            if reason:
                if (backend, pinning) not in refused_pinning:
                    not_honoured.append(NotHonoured("pinning", f"{backend}/{pinning}", reason))
                    refused_pinning.add((backend, pinning))
                continue
            if note and note not in notes:
                notes.append(note)
            for memory in memories:
                if memory != "local" and backend not in pinning_backends:
                    not_honoured.append(
                        NotHonoured(
                            "memory",
                            f"{backend}/{memory}",
                            f"backend {backend} cannot place memory",
                        )
                    )
                    continue
                for smt in smt_states:
                    configs.append(Configuration(backend, pinning, memory, smt))

    points, density_notes = density_points(
        cfg.densities, len(vcpus), cfg.iterations, cfg.min_samples_per_cell, cfg.repeats
    )
    notes.extend(density_notes)
    cells = [Cell(c, p, r) for r in range(cfg.repeats) for c in configs for p in points]
    plan = Plan(
        topology=topo,
        vcpus=vcpus,
        configurations=configs,
        points=points,
        repeats=cfg.repeats,
        iterations=cfg.iterations,
        cells=cells,
        not_honoured=not_honoured,
        notes=notes,
    )
    plan.estimated_s = estimate_duration_s(plan, cfg)
    return plan


def estimate_cell_s(cell: Cell, cfg: SweepConfig, num_vcpus: int) -> float:
    n = cell.point.num_sandboxes
    if cfg.workload_cmd is not None:
        work_s = 0.2
    elif cfg.workload == "episode":
        work_s = cfg.episode_turns * (WORKLOAD_S["episode"] + cfg.episode_think_s)
    else:
        work_s = WORKLOAD_S[cfg.workload]
    work_s *= cfg.workload_scale if cfg.workload_cmd is None else 1.0
    create_s = CREATE_S[cell.config.backend] * n / min(n, cfg.start_concurrency)
    create_s *= max(1.0, min(n, cfg.start_concurrency) / num_vcpus)
    per_iteration_s = work_s * max(1.0, n / num_vcpus) + 0.01
    return create_s + cell.point.iterations * per_iteration_s + 0.05


def estimate_duration_s(plan: Plan, cfg: SweepConfig) -> float:
    num_vcpus = len(plan.vcpus)
    noise_s = cfg.noise_check_runs * 0.02
    return noise_s + sum(estimate_cell_s(c, cfg, num_vcpus) for c in plan.cells)


def format_plan(plan: Plan, cfg: SweepConfig) -> str:
    """Human-readable plan (what --dry-run prints)."""
    topo = plan.topology
    lines = [
        f"host topology ({topo.sysfs_root}): {topo.num_cpus} online CPUs "
        f"({format_cpulist(topo.online_cpus)}), {topo.num_cores} cores, SMT "
        f"{'on' if topo.smt_active else 'off'}, {len(topo.packages)} package(s), "
        f"{topo.num_numa_nodes} NUMA node(s), {len(topo.l3_domains)} L3 domain(s)",
        f"sweep vCPUs: {format_cpulist(plan.vcpus)} ({len(plan.vcpus)})",
        f"workload: {cfg.workload_cmd and 'sh -c ' + repr(cfg.workload_cmd) or cfg.workload}"
        f" (scale {cfg.workload_scale:g}), timeout {cfg.timeout_s:g} s",
        "",
        f"configurations ({len(plan.configurations)}):",
    ]
    lines += [f"  {c.id}" for c in plan.configurations] or ["  (none: nothing can run)"]
    lines.append("densities (sandboxes per vCPU -> sandboxes):")
    lines += [
        f"  {p.density:g} -> {p.num_sandboxes} (effective {p.effective_density:.3g}), "
        f"{p.iterations} iterations per repeat"
        for p in plan.points
    ]
    samples = plan.to_dict()["num_samples"]
    lines.append(
        f"repeats {plan.repeats}, >= {plan.iterations} iterations: {len(plan.cells)} cells, "
        f"{samples} latency samples"
    )
    if plan.not_honoured:
        lines.append("NOT HONOURED on this host (requested, will not run):")
        lines += [f"  {n.option} {n.value}: {n.reason}" for n in plan.not_honoured]
    if plan.notes:
        lines.append("notes:")
        lines += [f"  {n}" for n in plan.notes]
    lines.append(
        f"estimated duration: {plan.estimated_s:.0f} s (~{plan.estimated_s / 60:.1f} min) on a quiet "
        "host; a loaded host stretches it"
    )
    return "\n".join(lines)
