"""`slipstream bench sandbox --case shared-agent`: N worker processes leasing through one host
agent vs N worker processes with a private `SandboxPool` each, on the same host, same template.

Each worker runs `concurrency` tasks, each `iterations` times: acquire -> exec the command ->
hold the lease `hold_ms` (the rest of a verification) -> release. Measured per setup:
- acquire latency p50/p99 (what a worker waits for a sandbox, round trip to the agent included);
- exec latency p50/p99 of the command, and a paired probe of the proxy's cost (one leased and
  one in-process sandbox, `echo` alternately, same moment, same load);
- sandboxes in flight against the admission limit (online vCPUs x max_density, vcpus = 1):
  peak and mean leases held at once (from the workers' own lease intervals, one monotonic clock),
  and peak live sandboxes on the host (journal entries, sampled every 10 ms: idle, leased,
  being created or destroyed), with the share of samples above the limit.
The private pools each admit against the whole host, so together they can hold N x the limit;
the agent holds every worker to one limit, so its workers wait longer for a sandbox instead.

Not covered: several agents per host, VM backends, real verification work (the hold is a
host-side sleep; the exec is the command).
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

CLI = [sys.executable, "-c", "import sys; from slipstream.cli import main; sys.exit(main())"]


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def _ms(xs_s: list[float]) -> dict[str, Any]:
    ms = [x * 1e3 for x in xs_s]
    return {"n": len(ms), "p50_ms": _pct(ms, 0.5), "p99_ms": _pct(ms, 0.99),
            "max_ms": max(ms) if ms else None}  # fmt: skip


def _worker(spec: dict[str, Any], start: Any, ready: Any, out_path: str) -> None:
    """One worker process: its pool (the agent's client or a private pool), then the loop."""
    from slipstream.sandbox import NoCapacity, PoolOptions, open_pool
    from slipstream.sandbox.base import SandboxTemplate

    tmpl = SandboxTemplate(**spec["template"])
    argv = spec["argv"]

    async def main() -> dict[str, Any]:
        pool = open_pool(tmpl, PoolOptions(**spec["options"]), state_dir=spec["state_dir"],
                         agent_url=spec["agent_url"])  # fmt: skip
        await pool.start()
        await pool.wait_ready(120)
        ready.set()
        await asyncio.get_running_loop().run_in_executor(None, start.wait)
        acquire_s: list[float] = []
        exec_s: list[float] = []
        spans: list[tuple[float, float]] = []
        no_capacity = [0]

        async def task() -> None:
            for _ in range(spec["iterations"]):
                t0 = time.perf_counter()
                try:
                    sb = await pool.acquire(timeout_s=spec["acquire_timeout_s"])
                except NoCapacity:
                    no_capacity[0] += 1
                    continue
                t1 = time.perf_counter()
                held_at = time.monotonic()
                r = await sb.exec(argv)
                exec_s.append(time.perf_counter() - t1)
                if r.exit_code != 0:
                    raise RuntimeError(f"{argv} failed in the sandbox: {r}")
                await asyncio.sleep(spec["hold_ms"] / 1e3)
                spans.append((held_at, time.monotonic()))
                await pool.release(sb)
                acquire_s.append(t1 - t0)

        t_start = time.monotonic()
        await asyncio.gather(*(task() for _ in range(spec["concurrency"])))
        wall_s = time.monotonic() - t_start
        await pool.stop()
        return {"acquire_s": acquire_s, "exec_s": exec_s, "spans": spans,
                "no_capacity": no_capacity[0], "wall_s": wall_s}  # fmt: skip

    Path(out_path).write_text(json.dumps(asyncio.run(main())))


def _overlap(spans: list[tuple[float, float]]) -> tuple[int, float]:
    """(peak, time-weighted mean) of intervals open at once."""
    events = sorted([(a, 1) for a, _ in spans] + [(b, -1) for _, b in spans])
    if not events:
        return 0, 0.0
    open_now = peak = 0
    area, last = 0.0, events[0][0]
    for t, step in events:
        area += open_now * (t - last)
        last = t
        open_now += step
        peak = max(peak, open_now)
    span = events[-1][0] - events[0][0]
    return peak, area / span if span > 0 else 0.0


def _run_setup(name: str, specs: list[dict[str, Any]], journals: list[Path], limit: int,
               tmp: Path) -> dict[str, Any]:  # fmt: skip
    ctx = multiprocessing.get_context("spawn")
    start = ctx.Event()
    readies = [ctx.Event() for _ in specs]
    outs = [tmp / f"{name}-{i}.json" for i in range(len(specs))]
    procs = [ctx.Process(target=_worker, args=(s, start, r, str(o)))
             for s, r, o in zip(specs, readies, outs, strict=True)]  # fmt: skip
    for p in procs:
        p.start()
    for r, p in zip(readies, procs, strict=True):
        while not r.wait(0.5):
            if not p.is_alive():
                raise RuntimeError(
                    f"bench {name}: a worker exited {p.exitcode} before it was ready"
                )
    live: list[int] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            live.append(sum(len(list(j.glob("*.json"))) for j in journals if j.exists()))
            time.sleep(0.01)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t0 = time.monotonic()
    start.set()
    for p in procs:
        p.join()
    wall_s = time.monotonic() - t0
    stop.set()
    sampler.join()
    if any(p.exitcode != 0 for p in procs):
        raise RuntimeError(f"bench {name}: worker exit codes {[p.exitcode for p in procs]}")
    res = [json.loads(o.read_text()) for o in outs]
    spans = [tuple(s) for r in res for s in r["spans"]]
    peak, mean = _overlap(spans)  # type: ignore[arg-type]
    over = sum(n > limit for n in live)
    return {
        "workers": len(specs),
        "acquire": _ms([x for r in res for x in r["acquire_s"]]),
        "exec": _ms([x for r in res for x in r["exec_s"]]),
        "leases": len(spans),
        "no_capacity": sum(r["no_capacity"] for r in res),
        "leases_per_s": len(spans) / wall_s,
        "wall_s": wall_s,
        "leased_peak": peak,
        "leased_mean": mean,
        "live_peak": max(live) if live else 0,
        "live_samples": len(live),
        "live_over_limit_share": over / len(live) if live else 0.0,
    }


async def _proxy_probe(
    url: str, tmpl: Any, state: Path, argv: list[str], runs: int
) -> dict[str, Any]:
    """exec latency of one leased and one in-process sandbox, alternately (paired)."""
    from slipstream.sandbox import AgentPool, PoolOptions, SandboxPool

    via, direct = [], []
    async with AgentPool(url, tmpl) as agent_pool, SandboxPool(
        tmpl, PoolOptions(min_idle=0, max_idle=0, max_density=4.0), state_dir=state
    ) as own:  # fmt: skip
        a, b = await agent_pool.acquire(timeout_s=60), await own.acquire(timeout_s=60)
        for i in range(runs + 5):
            for sb, out in ((a, via), (b, direct)) if i % 2 else ((b, direct), (a, via)):
                t0 = time.perf_counter()
                await sb.exec(argv)
                if i >= 5:
                    out.append(time.perf_counter() - t0)
        await agent_pool.release(a)
        await own.release(b)
    return {"via_agent": _ms(via), "in_process": _ms(direct)}


def run_shared_agent(args: Any) -> dict[str, Any]:
    """The case; returns the result dict (the caller adds provenance and writes it)."""
    from dataclasses import asdict

    from slipstream.sandbox.base import SandboxTemplate
    from slipstream.sandbox.pool import PoolOptions

    ncpu = len(os.sched_getaffinity(0))
    tmpl = SandboxTemplate(backend=args.agent_backend, memory_mib=128, workdir_mib=16,
                           create_timeout_s=120)  # fmt: skip
    opts = PoolOptions(min_idle=2, max_idle=4, max_density=args.max_density, reuse=args.reuse)
    limit = int(ncpu * args.max_density + 1e-9)
    conc = args.concurrency or limit  # each worker alone would fill the host
    argv = args.command.split()
    common = {"template": asdict(tmpl), "argv": argv, "iterations": args.iterations,
              "concurrency": conc, "hold_ms": args.hold_ms, "acquire_timeout_s": 60.0,
              "options": asdict(opts)}  # fmt: skip
    out: dict[str, Any] = {"case": "shared-agent", "ncpu": ncpu, "limit_sandboxes": limit,
                           "max_density": args.max_density, "workers": args.workers,
                           "concurrency_per_worker": conc, "iterations": args.iterations,
                           "hold_ms": args.hold_ms, "argv": argv, "backend": tmpl.backend,
                           "reuse": opts.reuse,
                           "loadavg_start": os.getloadavg()}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="bench-agent-") as d:
        tmp = Path(d)
        sock, state = tmp / "agent.sock", tmp / "agent-state"
        agent = subprocess.Popen(
            [*CLI, "sandbox", "serve", "--socket", str(sock), f"--sandbox.state_dir={state}",
             f"--sandbox.backend={tmpl.backend}", "--sandbox.memory_mib=128",
             "--sandbox.workdir_mib=16", "--sandbox.create_timeout_s=120",
             f"--sandbox.min_idle={opts.min_idle}", f"--sandbox.max_idle={opts.max_idle}",
             f"--sandbox.max_density={opts.max_density}", f"--sandbox.reuse={opts.reuse}",
             "--max-wait-s", "60"],
            stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 120
            while not sock.exists():
                if agent.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"host agent did not start: {agent.stderr.read()[-2000:]}")
                time.sleep(0.05)
            url = f"unix://{sock}"
            print("bench sandbox: shared agent ...", file=sys.stderr, flush=True)
            specs = [{**common, "agent_url": url, "state_dir": None} for _ in range(args.workers)]
            out["shared"] = _run_setup("shared", specs, [state / "journal"], limit, tmp)
            print("bench sandbox: proxy probe ...", file=sys.stderr, flush=True)
            out["proxy_exec"] = asyncio.run(
                _proxy_probe(url, tmpl, tmp / "probe-state", argv, args.probe_runs)
            )
        finally:
            agent.terminate()
            agent.wait(120)
        print("bench sandbox: private pools ...", file=sys.stderr, flush=True)
        states = [tmp / f"private-{i}" for i in range(args.workers)]
        specs = [{**common, "agent_url": "", "state_dir": str(s)} for s in states]
        out["private"] = _run_setup("private", specs, [s / "journal" for s in states], limit, tmp)
    out["loadavg_end"] = os.getloadavg()
    return out


def print_table(res: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    f = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
    t = Table(title=f"{res['workers']} workers x {res['concurrency_per_worker']} tasks x "
              f"{res['iterations']} leases, {res['backend']}, "
              f"{'reuse' if res['reuse'] else 'single use'}, hold {res['hold_ms']} ms; admission "
              f"limit {res['limit_sandboxes']} sandboxes ({res['ncpu']} vCPUs x "
              f"{res['max_density']:g}); load {res['loadavg_start'][0]:.1f} -> "
              f"{res['loadavg_end'][0]:.1f}")  # fmt: skip
    cols = ("setup", "acquire p50 ms", "acquire p99 ms", "exec p50 ms", "exec p99 ms",
            "leased peak / mean", "live peak", "samples over limit", "leases/s", "no capacity")  # fmt: skip
    for c in cols:
        t.add_column(c, justify="left" if c == "setup" else "right")
    for name, label in (
        ("shared", "shared agent (figure)"),
        ("private", "private pools (baseline)"),
    ):
        r = res[name]
        t.add_row(label, f(r["acquire"]["p50_ms"]), f(r["acquire"]["p99_ms"]),
                  f(r["exec"]["p50_ms"]), f(r["exec"]["p99_ms"]),
                  f"{r['leased_peak']} / {r['leased_mean']:.2f}", str(r["live_peak"]),
                  f"{100 * r['live_over_limit_share']:.0f}%", f"{r['leases_per_s']:.1f}",
                  str(r["no_capacity"]))  # fmt: skip
    t.add_row("admission limit", "", "", "", "", str(res["limit_sandboxes"]),
              str(res["limit_sandboxes"]), "0%", "", "")  # fmt: skip
    Console(width=180).print(t)
    p = res["proxy_exec"]
    print(
        f"proxy cost, `{' '.join(res['argv'])}` paired: via agent p50 "
        f"{f(p['via_agent']['p50_ms'])} / p99 {f(p['via_agent']['p99_ms'])} ms, in-process p50 "
        f"{f(p['in_process']['p50_ms'])} / p99 {f(p['in_process']['p99_ms'])} ms"
    )
