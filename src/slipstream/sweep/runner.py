"""Run a sweep plan: per cell, create the sandboxes, release the workload in all of them at once,
record one sample per sandbox per iteration; then write the run directory.

Sandboxes are created through `slipstream.sandbox` (`make_backend(name).create(...)`) with at most
`start_concurrency` creations in flight, each given the CPU set its pinning policy assigns (the
sweep assigns round-robin over cores / threads / L3 domains, so densities above 1.0 share units:
that oversubscription is what the sweep measures, which the pool's admission control would
refuse). All workload tasks of an iteration wait on one asyncio.Event that is set only after every
task is waiting: the barrier. Failures (create errors, non-zero exits, timeouts, OOM kills,
crashed sandboxes) become failed samples with their reason; none is dropped.

Not covered: dynamic churn (sandboxes are fixed for a cell, as in seed 002), SMT switching.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from slipstream.config.sweep import SweepConfig
from slipstream.sandbox.host_topology import Topology, format_cpulist
from slipstream.sweep.matrix import Cell, Plan
from slipstream.sweep.samples import Sample
from slipstream.sweep.workloads import Workload

log = logging.getLogger(__name__)

# The host waits this long past the sample's timeout before it declares the exec hung itself.
HOST_GRACE_S = 10.0


def pinning_units(pinning: str, topo: Topology, vcpus: tuple[int, ...]) -> list[tuple[int, ...]]:
    """The CPU sets a policy hands out, in hand-out order (restricted to the sweep's vCPUs).

    core: each physical core's threads; thread: one hardware thread, first threads of every core
    before any second sibling (so low densities never share a core); l3: each L3 domain.
    """
    allowed = set(vcpus)

    def keep(cpus: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(c for c in cpus if c in allowed)

    if pinning == "core":
        units = [keep(c) for c in topo.cores]
    elif pinning == "thread":
        depth = topo.threads_per_core
        units = [(core[k],) for k in range(depth) for core in topo.cores if k < len(core)]
        units = [keep(u) for u in units]
    elif pinning == "l3":
        units = [keep(d) for d in topo.l3_domains]
    else:
        raise ValueError(f"pinning {pinning!r} hands out no CPU sets")
    return [u for u in units if u]


def assign(
    pinning: str, memory: str, topo: Topology, vcpus: tuple[int, ...], num_sandboxes: int
) -> list[tuple[tuple[int, ...] | None, tuple[int, ...] | None]]:
    """(cpus, mems) per sandbox. Round-robin over the policy's units; `local` memory is the nodes
    of the sandbox's CPUs (None when unpinned: the kernel's first-touch default), `interleave`
    is every node with memory (the sandbox layer applies it as cpuset.mems; it does not set an
    MPOL_INTERLEAVE policy). None on a one-node host, like `sandbox.pinning.PinningAllocator`."""
    all_nodes = tuple(n for n, (_, mem) in topo.numa_nodes.items() if mem > 0) or tuple(
        topo.numa_nodes
    )
    units = pinning_units(pinning, topo, vcpus) if pinning != "none" else []
    out = []
    for i in range(num_sandboxes):
        cpus = units[i % len(units)] if units else None
        if len(all_nodes) <= 1:  # as the sandbox pool does: cpuset.mems left alone on one node
            mems = None
        elif memory == "interleave":
            mems = all_nodes
        elif cpus is not None:
            mems = tuple(sorted({n for c in cpus if (n := topo.node_of_cpu(c)) is not None}))
        else:
            mems = None
        out.append((cpus, mems or None))
    return out


@dataclass
class CellResult:
    samples: list[Sample]
    wall_s: float


def _sample(cell: Cell, iteration: int, index: int, cpus: tuple[int, ...] | None, **kw) -> Sample:
    c = cell.config
    return Sample(
        config_id=c.id,
        backend=c.backend,
        pinning=c.pinning,
        memory=c.memory,
        smt=c.smt,
        density=cell.point.density,
        num_sandboxes=cell.point.num_sandboxes,
        repeat=cell.repeat,
        iteration=iteration,
        sandbox=index,
        cpus=format_cpulist(cpus) if cpus else "",
        **kw,
    )


def _short(text: str, limit: int = 160) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


async def _one_sample(box, workload: Workload, timeout_s: float, t0: float) -> dict:
    """Run the workload's turns; returns Sample fields ok/reason/detail/t_start_s/latency_s."""
    from slipstream.sandbox.errors import SandboxError

    start = time.perf_counter()
    deadline = start + timeout_s
    reason = detail = ""
    try:
        for k, argv in enumerate(workload.turns):
            if k and workload.think_s:
                await asyncio.sleep(workload.think_s)
            budget_s = deadline - time.perf_counter()
            if budget_s <= 0:
                reason, detail = "timeout", f"timed out before turn {k}"
                break
            res = await asyncio.wait_for(
                box.exec(argv, timeout_s=budget_s), budget_s + HOST_GRACE_S
            )
            if res.timed_out:
                reason, detail = "timeout", f"turn {k} timed out"
            elif res.oom_killed:
                reason, detail = "oom", f"turn {k} OOM-killed"
            elif res.exit_code != 0:
                reason = "exit"
                detail = f"turn {k} exit {res.exit_code}: {_short(res.stderr[-400:])}"
            if reason:
                break
    except TimeoutError:
        reason, detail = "timeout", "the host gave up waiting for the sandbox (hung agent)"
    except SandboxError as e:
        reason, detail = "crash", _short(f"{type(e).__name__}: {e}")
    end = time.perf_counter()
    return {
        "ok": not reason,
        "reason": reason,
        "detail": detail,
        "t_start_s": start - t0,
        "latency_s": end - start,
    }


async def run_cell(
    backend, cell: Cell, plan: Plan, cfg: SweepConfig, workload: Workload, t0: float
):
    """Create the cell's sandboxes, run the point's barrier-released iterations, release them."""
    from slipstream.sandbox.base import SandboxTemplate
    from slipstream.sandbox.errors import SandboxError

    n = cell.point.num_sandboxes
    placement = assign(cell.config.pinning, cell.config.memory, plan.topology, plan.vcpus, n)
    template = SandboxTemplate(
        backend=cell.config.backend,
        memory_mib=cfg.memory_mib,
        workdir_mib=min(64, cfg.memory_mib // 2),
        pinning=cell.config.pinning,
        memory_policy=cell.config.memory,
        exec_timeout_s=cfg.timeout_s,
    )
    sem = asyncio.Semaphore(cfg.start_concurrency)
    run_id = uuid.uuid4().hex[:8]

    async def create(i: int):
        cpus, mems = placement[i]
        async with sem:
            try:
                return await backend.create(
                    template, sandbox_id=f"sweep-{run_id}-{i}", cpus=cpus, mems=mems
                )
            except SandboxError as e:
                log.warning("sweep %s: sandbox %d failed to start: %s", cell.config.id, i, e)
                return e

    started = time.perf_counter()
    boxes = await asyncio.gather(*(create(i) for i in range(n)))
    samples: list[Sample] = []
    try:
        for it in range(cell.point.iterations):
            barrier = asyncio.Event()
            ready = 0
            all_ready = asyncio.Event()

            async def one(box, it=it, barrier=barrier, all_ready=all_ready):
                nonlocal ready
                ready += 1
                if ready == n:
                    all_ready.set()
                await barrier.wait()
                return await _one_sample(box, workload, cfg.timeout_s, t0)

            tasks = {}
            for i, box in enumerate(boxes):
                if isinstance(box, BaseException):
                    samples.append(
                        _sample(
                            cell,
                            it,
                            i,
                            placement[i][0],
                            ok=False,
                            reason="create",
                            detail=_short(f"{type(box).__name__}: {box}"),
                            t_start_s=math.nan,
                            latency_s=math.nan,
                        )
                    )
                    ready += 1
                else:
                    tasks[i] = asyncio.create_task(one(box))
            if ready == n:
                all_ready.set()
            await all_ready.wait()
            barrier.set()
            for i, task in tasks.items():
                samples.append(_sample(cell, it, i, placement[i][0], **(await task)))
    finally:
        live = [b for b in boxes if not isinstance(b, BaseException)]
        results = await asyncio.gather(*(b.release() for b in live), return_exceptions=True)
        for b, r in zip(live, results, strict=True):
            if isinstance(r, BaseException):
                log.warning("sweep: releasing %s failed: %s", b, r)
    samples.sort(key=lambda s: (s.iteration, s.sandbox))
    return CellResult(samples, time.perf_counter() - started)


def noise_check(runs: int, loop_n: int = 300_000) -> dict:
    """Time a fixed in-process loop `runs` times on the (supposedly) idle host; CV > 10% = noisy."""
    import numpy as np

    load = Path("/proc/loadavg").read_text().split()[:3] if Path("/proc/loadavg").exists() else []
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        x = 0
        for i in range(loop_n):
            x += i & 7
        times.append(time.perf_counter() - t)
    out: dict = {"runs": runs, "loop_n": loop_n, "loadavg_before": [float(v) for v in load]}
    if runs:
        a = np.array(times)
        cv = float(a.std(ddof=1) / a.mean()) if runs > 1 else 0.0
        out.update(
            p50_s=round(float(np.median(a)), 6),
            min_s=round(float(a.min()), 6),
            max_s=round(float(a.max()), 6),
            cv=round(cv, 4),
            verdict="noisy (CV > 10%): expect inflated tails" if cv > 0.10 else "quiet",
        )
    out["cpu_count"] = os.cpu_count()
    return out
