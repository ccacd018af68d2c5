"""`slipstream bench sandbox`: sandbox latency per backend, next to a plain subprocess (the limit).

For the same command (default `echo ok`), in one run on one machine:
- plain:  `subprocess.run(argv)` on the host — no isolation, the floor any sandbox is compared to;
- cold:   backend.create(template) + exec (sandbox creation on the critical path), then release;
- warm:   SandboxPool.acquire() (health-check ping included) + exec, single use — the pool holds a
          warm sandbox before each timed acquire (refill time is not on the critical path, which is
          the point of a warm pool); release/destroy happens outside the timed region;
- reuse:  the same with `reuse=True` (release = reset, the sandbox goes back to the pool).
p50/p99 over --runs runs. VM backends under TCG take seconds per boot, so their cold and single-use
warm modes (one boot per run) use --vm-cold-runs; their reuse mode uses --runs.

Goals checked: bwrap warm p50 <= plain p50 + 2 ms and bwrap warm p99 <= 10 ms; qemu warm p50 at
least 100x below qemu cold p50. Writes JSON with provenance to benchmarks/results/sandbox.json.

`--case shared-agent`: N worker processes leasing through one host agent vs N private pools:
acquire p50/p99 and sandboxes in flight against the admission limit (bench/sandbox_agent.py;
JSON to benchmarks/results/sandbox-shared-agent.json).

Not covered: concurrency/density (the density harness does that), commands heavier than the
spawn itself, firecracker (no binary on the dev machines; included when its module can create).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

GOAL_WARM_P50_OVER_PLAIN_MS = 2.0
GOAL_WARM_P99_MS = 10.0
GOAL_VM_COLD_OVER_WARM = 100.0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sandbox", help="sandbox cold vs warm latency per backend vs plain subprocess",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument(
        "--backends", default="process,bwrap,qemu", help="comma list; unavailable ones are skipped"
    )
    p.add_argument("--runs", type=int, default=200, help="timed runs per mode")
    p.add_argument(
        "--vm-cold-runs",
        type=int,
        default=20,
        help="VM backends: timed cold boots, and single-use warm runs (each needs a boot)",
    )
    p.add_argument("--command", default="echo ok", help="the command (split on spaces)")
    p.add_argument("--out", default=None, help="JSON output path (default: "
                   "benchmarks/results/sandbox.json, or sandbox-shared-agent.json for that case)")  # fmt: skip
    p.add_argument("--case", choices=("latency", "shared-agent"), default="latency",
                   help="latency: per backend (above); shared-agent: N worker processes through "
                   "one host agent vs N private pools (bench/sandbox_agent.py)")  # fmt: skip
    g = p.add_argument_group("shared-agent case")
    g.add_argument("--workers", type=int, default=2, help="worker processes")
    g.add_argument("--concurrency", type=int, default=0,
                   help="tasks per worker (default 0 = the admission limit: each alone fills the host)")  # fmt: skip
    g.add_argument("--iterations", type=int, default=25, help="leases per task")
    g.add_argument(
        "--hold-ms", type=float, default=100.0, help="how long each lease is held after its exec"
    )
    g.add_argument("--max-density", type=float, default=1.0, help="admission: sandboxes per vCPU")
    g.add_argument("--agent-backend", default="bwrap", choices=("process", "bwrap"))
    g.add_argument("--reuse", action="store_true",
                   help="reset and reuse released sandboxes (takes creation off the acquire path)")  # fmt: skip
    g.add_argument(
        "--probe-runs", type=int, default=100, help="paired execs of the proxy-cost probe"
    )
    p.set_defaults(func=run)


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def summary(xs_s: list[float]) -> dict[str, Any]:
    ms = [x * 1e3 for x in xs_s]
    return {
        "runs": len(ms),
        "p50_ms": _pct(ms, 0.5),
        "p99_ms": _pct(ms, 0.99),
        "mean_ms": statistics.fmean(ms),
        "max_ms": max(ms),
    }


def plain_once(argv: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(argv, capture_output=True, check=True)
    return time.perf_counter() - t0


def bench_plain(argv: list[str], runs: int) -> list[float]:
    for _ in range(5):
        plain_once(argv)
    return [plain_once(argv) for _ in range(runs)]


async def bench_backend(
    name: str, argv: list[str], runs: int, cold_runs: int, state: Path
) -> dict[str, Any]:
    """cold: `cold_runs` create+exec; warm (single use: one creation per run): `cold_runs` too;
    reuse: `runs`. For process/bwrap the caller passes cold_runs == runs."""
    from slipstream.sandbox.agent_pool import open_pool
    from slipstream.sandbox.base import SandboxTemplate, make_backend
    from slipstream.sandbox.journal import Journal
    from slipstream.sandbox.pool import PoolOptions

    tmpl = SandboxTemplate(backend=name, memory_mib=256 if name != "process" else 1024, workdir_mib=32,
                           create_timeout_s=180)  # fmt: skip
    journal = Journal(state)
    backend = make_backend(name, state_dir=state, journal=journal)
    res: dict[str, Any] = {"backend": name}
    cold, plain = [], []
    for i in range(cold_runs + 1):
        p = plain_once(argv)
        t0 = time.perf_counter()
        sb = await backend.create(tmpl, sandbox_id=f"bench-{os.getpid()}-{name}-{i}")
        r = await sb.exec(argv)
        dt = time.perf_counter() - t0
        await sb.release()
        if r.exit_code != 0:
            raise RuntimeError(f"{name}: {argv} failed in the sandbox: {r}")
        if i:  # the first run warms caches (image build, page cache)
            cold.append(dt)
            plain.append(p)
    res["cold"] = summary(cold)
    res["cold_plain"] = summary(plain)
    for mode, reuse, n in (("warm", False, cold_runs), ("reuse", True, runs)):
        opts = PoolOptions(
            min_idle=1, max_idle=1, reuse=reuse, max_density=2.0, create_concurrency=1
        )
        samples, plain = [], []
        async with open_pool(tmpl, opts, backend=backend, state_dir=state) as pool:
            for i in range(n + 3):
                await pool.wait_ready(300)
                await _settle(pool)
                p = plain_once(argv)  # paired: same moment, same machine load
                t0 = time.perf_counter()
                sb = await pool.acquire()
                r = await sb.exec(argv)
                dt = time.perf_counter() - t0
                await pool.release(sb)
                if r.exit_code != 0:
                    raise RuntimeError(f"{name} {mode}: {argv} failed: {r}")
                if i >= 3:
                    samples.append(dt)
                    plain.append(p)
            res[f"{mode}_pool_stats"] = {
                k: v for k, v in pool.stats().__dict__.items() if k not in ("notes",)
            }
        res[mode] = summary(samples)
        res[f"{mode}_plain"] = summary(plain)
    return res


async def _settle(pool: Any) -> None:
    """Wait until no sandbox is being created or destroyed, so each timed acquire+exec measures the
    warm path and not contention with the pool's own background work on a small machine."""
    while pool.stats().creating or pool._destroying:  # noqa: SLF001
        await asyncio.sleep(0.002)


def _table(results: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    plain = results["plain"]
    t = Table(
        title=f"sandbox latency: {' '.join(results['argv'])}  "
        "(plain = subprocess.run of the same command, the limit; 'paired' = timed right before "
        "each sandbox run, under the same load)"
    )
    cols = ("backend", "mode", "p50 ms", "p99 ms", "paired plain p50/p99", "p50 - plain",
            "p50 / plain", "goal", "met")  # fmt: skip
    for c in cols:
        t.add_column(c, justify="left" if c in ("backend", "mode", "goal") else "right")
    t.add_row("host", "plain", f"{plain['p50_ms']:.2f}", f"{plain['p99_ms']:.2f}", "", "", "1.0x",
              "limit", "")  # fmt: skip
    for b in results["backends"]:
        if "error" in b:
            t.add_row(b["backend"], "unavailable", "", "", "", "", "", b["error"][:60], "")
            continue
        for mode in ("cold", "warm", "reuse"):
            s, pp = b[mode], b[f"{mode}_plain"]
            goals = [g for g in b.get("goals", []) if g["mode"] == mode]
            t.add_row(b["backend"], mode, f"{s['p50_ms']:.2f}", f"{s['p99_ms']:.2f}",
                      f"{pp['p50_ms']:.2f} / {pp['p99_ms']:.2f}",
                      f"{s['p50_ms'] - pp['p50_ms']:+.2f}", f"{s['p50_ms'] / pp['p50_ms']:.1f}x",
                      "; ".join(g["goal"] for g in goals),
                      " ".join("yes" if g["met"] else "NO" for g in goals))  # fmt: skip
    Console(width=160).print(t)


def goals_for(b: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's goals, against the plain subprocess timed under the same load (paired)."""
    out = []
    # bwrap: both warm pool modes, single use (the default) and reuse-with-reset
    for mode in ("warm", "reuse") if b["backend"] == "bwrap" else ():
        over = b[mode]["p50_ms"] - b[f"{mode}_plain"]["p50_ms"]
        out.append({"mode": mode, "goal": f"p50 <= plain + {GOAL_WARM_P50_OVER_PLAIN_MS:g} ms",
                    "value_ms": over, "met": over <= GOAL_WARM_P50_OVER_PLAIN_MS})  # fmt: skip
        out.append({"mode": mode, "goal": f"p99 <= {GOAL_WARM_P99_MS:g} ms",
                    "value_ms": b[mode]["p99_ms"], "met": b[mode]["p99_ms"] <= GOAL_WARM_P99_MS})  # fmt: skip
    if b["backend"] in ("qemu", "firecracker"):
        ratio = b["cold"]["p50_ms"] / b["warm"]["p50_ms"]
        out.append({"mode": "warm", "goal": f"cold/warm >= {GOAL_VM_COLD_OVER_WARM:g}x",
                    "value": ratio, "met": ratio >= GOAL_VM_COLD_OVER_WARM})  # fmt: skip
    return out


def run(args: argparse.Namespace) -> int:
    from slipstream.observe.provenance import collect_provenance, write_result
    from slipstream.sandbox.errors import BackendUnavailable, SandboxError
    from slipstream.sandbox.host_topology import read_topology

    logging.basicConfig(level=logging.ERROR)
    if args.case == "shared-agent":
        return run_shared_agent_case(args)
    argv = args.command.split()
    results: dict[str, Any] = {"argv": argv, "runs": args.runs, "vm_cold_runs": args.vm_cold_runs}
    results["loadavg_start"] = os.getloadavg()  # the dev machines are shared: record how busy
    results["plain"] = summary(bench_plain(argv, args.runs))
    results["backends"] = []
    with tempfile.TemporaryDirectory(prefix="bench-sandbox-") as tmp:
        for name in args.backends.split(","):
            vm = name in ("qemu", "firecracker")
            print(f"bench sandbox: {name} ...", file=sys.stderr, flush=True)
            try:
                b = asyncio.run(bench_backend(name, argv, args.runs,
                                              args.vm_cold_runs if vm else args.runs, Path(tmp) / name))  # fmt: skip
            except (BackendUnavailable, SandboxError, OSError, RuntimeError) as e:
                results["backends"].append({"backend": name, "error": f"{type(e).__name__}: {e}"})
                continue
            b["goals"] = goals_for(b)
            results["backends"].append(b)
    results["loadavg_end"] = os.getloadavg()
    results["provenance"] = collect_provenance(
        {"benchmark": "sandbox", "topology": read_topology().to_dict()}
    )
    out = write_result(args.out or "benchmarks/results/sandbox.json", results)
    _table(results)
    print(f"wrote {out}", file=sys.stderr)
    return 0


def run_shared_agent_case(args: argparse.Namespace) -> int:
    """N workers through one host agent vs N private pools (bench/sandbox_agent.py)."""
    from slipstream.bench.sandbox_agent import print_table, run_shared_agent
    from slipstream.observe.provenance import collect_provenance, write_result
    from slipstream.sandbox.errors import SandboxError
    from slipstream.sandbox.host_topology import read_topology

    for name, v in (("--workers", args.workers), ("--iterations", args.iterations)):
        if v < 1:
            print(f"slipstream bench sandbox: {name} must be >= 1", file=sys.stderr)
            return 2
    try:
        results = run_shared_agent(args)
    except (SandboxError, OSError, RuntimeError) as e:
        print(f"slipstream bench sandbox: {e}", file=sys.stderr)
        return 1
    results["provenance"] = collect_provenance(
        {"benchmark": "sandbox-shared-agent", "topology": read_topology().to_dict()}
    )
    out = write_result(args.out or "benchmarks/results/sandbox-shared-agent.json", results)
    print_table(results)
    print(f"wrote {out}", file=sys.stderr)
    return 0
