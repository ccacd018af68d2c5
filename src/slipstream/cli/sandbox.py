"""`slipstream sandbox run|pool|doctor|build-image|reap|serve|status`: sandboxes from the CLI.

slipstream sandbox run --backend bwrap -- python3 -c 'print(1)'
slipstream sandbox pool -c job.toml --execs 200 --concurrency 2   # live pool statistics
slipstream sandbox doctor            # which backends work on this host, and why not
slipstream sandbox build-image       # the qemu/firecracker guest image (cached)
slipstream sandbox reap              # remove what a crashed pool left (journal orphans)
slipstream sandbox serve --socket /run/slipstream/sandbox-agent.sock   # the node's host agent
slipstream sandbox status unix:///run/slipstream/sandbox-agent.sock     # its stats (cli/sandbox_agent.py)

Bad options are argparse errors (a usage line, exit 2); a template the sandbox layer refuses
(unknown backend, sizes too small) is a config error (exit 2); a backend that cannot run here
or a sandbox that breaks is one line `slipstream sandbox: ...` (exit 1). None is a traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import sys
import time
from typing import Any

from slipstream.cli import add_config_args
from slipstream.cli.sandbox_args import sandbox_failure, sandbox_template

BACKENDS = ("process", "bwrap", "qemu", "firecracker")  # slipstream.sandbox.base.BACKEND_NAMES


def _seconds(text: str) -> float:
    """argparse type: a finite number of seconds > 0."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not (math.isfinite(v) and v > 0):
        raise argparse.ArgumentTypeError(f"{text!r}: seconds must be finite and > 0")
    return v


def _count(minimum: int):  # type: ignore[no-untyped-def]
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if v < minimum:
            raise argparse.ArgumentTypeError(f"{text!r}: must be >= {minimum}")
        return v

    return parse


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sandbox", help="run commands in sandboxes, pool stats, host checks")
    ssub = p.add_subparsers(dest="sandbox_command", metavar="ACTION", required=True)

    r = ssub.add_parser("run", help="run one command in a fresh sandbox (argv after --)")
    add_config_args(r)
    r.add_argument("--backend", default=None, choices=BACKENDS, help="default: config")
    r.add_argument("--timeout", type=_seconds, default=None, help="command timeout in seconds")
    r.add_argument("--memory-mib", type=_count(16), default=None,
                   help="memory limit (default: config)")  # fmt: skip
    r.add_argument("--stdin", action="store_true", help="pass this process's stdin to the command")
    r.add_argument("--json", action="store_true", help="print the ExecResult as JSON")
    r.add_argument("argv", nargs=argparse.REMAINDER, help="-- COMMAND [ARGS...]")
    r.set_defaults(func=cmd_run)

    pl = ssub.add_parser("pool", help="start a warm pool per config, run N execs, show live stats")
    add_config_args(pl)
    pl.add_argument("--execs", type=_count(1), default=50, help="commands to run through the pool")
    pl.add_argument("--concurrency", type=_count(1), default=2, help="commands in flight at once")
    pl.add_argument("--command", default="echo ok", help="shell command each exec runs")
    pl.set_defaults(func=cmd_pool)

    d = ssub.add_parser("doctor", help="which backends work on this host and why not")
    d.add_argument(
        "--boot", action="store_true", help="also boot a test VM for qemu (slow under TCG)"
    )
    d.add_argument("--json", action="store_true")
    d.set_defaults(func=cmd_doctor)

    b = ssub.add_parser("build-image", help="build (or reuse) the microVM guest image")
    b.add_argument("--cache-dir", default=None)
    b.add_argument("--force", action="store_true", help="rebuild even if inputs are unchanged")
    b.set_defaults(func=cmd_build_image)

    rp = ssub.add_parser("reap", help="reap sandboxes whose owner died (journal orphans)")
    add_config_args(rp)
    rp.set_defaults(func=cmd_reap)

    from slipstream.cli.sandbox_agent import register_actions

    register_actions(ssub, _seconds, _count)  # serve, status: the node's host agent


def cmd_run(args: argparse.Namespace) -> int:
    from slipstream.sandbox.base import make_backend

    argv = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    if not argv:
        print("slipstream sandbox run: give the command after --", file=sys.stderr)
        return 2
    cfg, tmpl = sandbox_template(args, backend=args.backend, memory_mib=args.memory_mib)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    stdin = sys.stdin.buffer.read() if args.stdin else None

    async def go():  # type: ignore[no-untyped-def]
        backend = make_backend(tmpl.backend, state_dir=cfg.state_dir)
        t0 = time.perf_counter()
        sb = await backend.create(tmpl, sandbox_id=f"run-{os.getpid()}")
        t1 = time.perf_counter()
        try:
            res = await sb.exec(argv, stdin=stdin, timeout_s=args.timeout)
        finally:
            await sb.release()
        return res, t1 - t0

    from slipstream.sandbox.errors import SandboxError

    try:
        res, create_s = asyncio.run(go())
    except SandboxError as e:
        return sandbox_failure(e)
    if args.json:
        print(json.dumps({**res.to_dict(), "create_s": create_s}, indent=2))
    else:
        sys.stdout.write(res.stdout)
        sys.stderr.write(res.stderr)
        flags = [f for f in ("timed_out", "oom_killed", "truncated") if getattr(res, f)]
        print(
            f"[{tmpl.backend}] exit={res.exit_code} wall={res.wall_s * 1e3:.1f}ms "
            f"cpu={res.cpu_s * 1e3:.1f}ms peak_mem={(res.peak_memory_bytes or 0) / 2**20:.1f}MiB "
            f"create={create_s * 1e3:.1f}ms {' '.join(flags)}",
            file=sys.stderr,
        )
    if res.exit_code is None or res.exit_code < 0:
        return 128 + (res.signal or 9)
    return res.exit_code


def _stats_table(pool: Any, done: int, total: int, failures: int):  # type: ignore[no-untyped-def]
    from rich.table import Table

    st = pool.stats()
    t = Table(title=f"sandbox pool ({pool.template.backend}, pinning={st.pinning})")
    t.add_column("stat")
    t.add_column("value", justify="right")
    ms = lambda s: "-" if s is None else f"{s * 1e3:.2f} ms"  # noqa: E731
    rows = [
        ("execs done", f"{done}/{total}"),
        ("exec failures", str(failures)),
        ("live", str(st.live)),
        ("idle", str(st.idle)),
        ("in use", str(st.in_use)),
        ("creating", str(st.creating)),
        ("created", str(st.created)),
        ("destroyed", str(st.destroyed)),
        ("create failures", str(st.create_failures)),
        ("health failures", str(st.health_failures)),
        ("acquire wait p50", ms(st.acquire_wait_p50_s)),
        ("acquire wait p99", ms(st.acquire_wait_p99_s)),
        ("vCPU capacity", f"{st.vcpu_capacity:g}"),
    ]
    for k, v in rows:
        t.add_row(k, v)
    for n in st.notes:
        t.add_row("note", n)
    return t


def cmd_pool(args: argparse.Namespace) -> int:
    from rich.live import Live

    from slipstream.sandbox.agent_pool import open_pool
    from slipstream.sandbox.pool import PoolOptions

    cfg, tmpl = sandbox_template(args)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    opts = PoolOptions.from_config(cfg)
    state = {"done": 0, "failures": 0}

    async def go() -> None:
        async with open_pool(tmpl, opts, state_dir=cfg.state_dir) as pool:
            if reaped := pool.stats().orphans_reaped:
                print(f"reaped {reaped} orphaned sandboxes", file=sys.stderr)
            queue: asyncio.Queue[int] = asyncio.Queue()
            for i in range(args.execs):
                queue.put_nowait(i)

            async def worker() -> None:
                while not queue.empty():
                    queue.get_nowait()
                    async with pool.sandbox() as sb:
                        r = await sb.exec(["sh", "-c", args.command])
                    state["done"] += 1
                    state["failures"] += 0 if r.ok else 1

            with Live(_stats_table(pool, 0, args.execs, 0), refresh_per_second=8) as live:
                workers = [asyncio.ensure_future(worker()) for _ in range(args.concurrency)]
                while not all(w.done() for w in workers):
                    live.update(_stats_table(pool, state["done"], args.execs, state["failures"]))
                    await asyncio.sleep(0.125)
                await asyncio.gather(*workers)
                live.update(_stats_table(pool, state["done"], args.execs, state["failures"]))

    from slipstream.sandbox.errors import SandboxError

    try:
        asyncio.run(go())
    except SandboxError as e:
        return sandbox_failure(e)
    return 0 if state["failures"] == 0 else 1


def doctor_report(boot: bool = False) -> list[dict[str, Any]]:
    """One row per backend: {backend, ok, detail}. Every check actually runs the thing (each
    backend's `probe`)."""
    from slipstream.sandbox.base import BACKEND_NAMES, backend_class
    from slipstream.sandbox.errors import BackendUnavailable

    rows: list[dict[str, Any]] = []
    for name in BACKEND_NAMES:
        try:
            ok, detail = backend_class(name).probe(boot=boot)
        except BackendUnavailable as e:  # its module is missing
            ok, detail = False, str(e)
        rows.append({"backend": name, "ok": ok, "detail": detail})
    return rows


def cmd_doctor(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from slipstream.sandbox.host_topology import read_topology

    logging.basicConfig(level=logging.ERROR)
    rows = doctor_report(boot=args.boot)
    topo = read_topology()
    if args.json:
        print(json.dumps({"backends": rows, "topology": topo.to_dict()}, indent=2))
        return 0
    t = Table(title="slipstream sandbox doctor")
    t.add_column("backend")
    t.add_column("works")
    t.add_column("detail / why not")
    for r in rows:
        t.add_row(r["backend"], "[green]yes[/]" if r["ok"] else "[red]no[/]", r["detail"])
    console = Console()
    console.print(t)
    console.print(
        f"topology: {topo.num_cpus} CPUs, {topo.num_cores} cores, SMT {'on' if topo.smt_active else 'off'}, "
        f"{topo.num_numa_nodes} NUMA node(s), {len(topo.l3_domains)} L3 domain(s)"
    )
    return 0 if any(r["ok"] and r["backend"] != "process" for r in rows) else 1


def cmd_build_image(args: argparse.Namespace) -> int:
    try:
        from slipstream.sandbox.image import build_image
    except ModuleNotFoundError as e:
        print(f"slipstream sandbox build-image: image builder unavailable: {e}", file=sys.stderr)
        return 1
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        paths = build_image(args.cache_dir, force=args.force)
    except (RuntimeError, PermissionError) as e:  # a missing input, SandboxError, UnsafeDirError
        return sandbox_failure(e)
    print(paths)
    return 0


def cmd_reap(args: argparse.Namespace) -> int:
    from slipstream.config import load_config
    from slipstream.sandbox.base import reaper_for
    from slipstream.sandbox.journal import Journal, default_state_dir

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    cfg = load_config(args.config, args.overrides).sandbox
    try:
        journal = Journal(cfg.state_dir or default_state_dir())
    except PermissionError as e:  # rundir.UnsafeDirError: a state dir another user controls
        return sandbox_failure(e)
    n = journal.reap_orphans(reaper_for)
    live = len(journal.entries())
    print(f"reaped {n} orphaned sandboxes; {live} live sandboxes belong to running owners")
    return 0
