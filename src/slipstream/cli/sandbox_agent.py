"""`slipstream sandbox serve|status`: the node's host agent and a probe of it (registered by
cli/sandbox.py).

slipstream sandbox serve --socket /run/slipstream/sandbox-agent.sock     # one per node
slipstream sandbox status unix:///run/slipstream/sandbox-agent.sock       # exit 1 if unreachable

`serve` takes the sandbox template and pool options from the job config's `[sandbox]` section
(-c FILE plus --sandbox.* overrides: rollout workers must use the same template), starts the
warm pool (reaping what a crashed earlier agent left), then listens. SIGTERM or SIGINT drains:
the socket goes away (no new clients) while connected workers are still served, until they all
disconnect or --drain-timeout-s passes; then every sandbox is destroyed.
A backend that cannot run, another agent on the same socket or state dir, or a socket path that
is not a socket is one line `slipstream sandbox: ...` (exit 1).
"""

from __future__ import annotations

import argparse
import asyncio
import grp
import json
import logging
import os
import signal
import sys
from typing import Any

from slipstream.config.args import add_config_args

DEFAULT_SOCKET = "/run/slipstream/sandbox-agent.sock"  # = host_protocol.DEFAULT_SOCKET


def _octal_mode(text: str) -> int:
    try:
        mode = int(text, 8)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an octal mode such as 0660") from None
    if not 0 <= mode <= 0o777:
        raise argparse.ArgumentTypeError(f"{text!r}: a socket mode is between 000 and 777")
    return mode


def _group(text: str) -> int:
    if text.isdigit():
        return int(text)
    try:
        return grp.getgrnam(text).gr_gid
    except KeyError:
        raise argparse.ArgumentTypeError(f"no group named {text!r}") from None


def _cpus(text: str) -> list[int]:
    from slipstream.sandbox.host_topology import parse_cpulist

    try:
        cpus = parse_cpulist(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"--cpus {text!r}: {e}") from None
    if not cpus:
        raise argparse.ArgumentTypeError(f"--cpus {text!r} names no CPU")
    return cpus


def register_actions(ssub: argparse._SubParsersAction, seconds: Any, count: Any) -> None:
    """Add `serve` and `status` to the `slipstream sandbox` parser (seconds/count: its types)."""
    s = ssub.add_parser("serve", help="the node's host agent: lease sandboxes over a Unix socket",
                        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    add_config_args(s)
    s.add_argument(
        "--socket", default=DEFAULT_SOCKET, help=f"socket path (default {DEFAULT_SOCKET})"
    )
    s.add_argument("--lease-ttl-s", type=seconds, default=30.0,
                   help="a client that sends nothing for this long loses its leases (default 30)")  # fmt: skip
    s.add_argument("--max-wait-s", type=float, default=30.0,
                   help="longest an acquire may wait for capacity; 0 = never wait (default 30)")  # fmt: skip
    s.add_argument("--max-waiters", type=count(0), default=None,
                   help="most acquires waiting at once; more get 'no capacity' (default: no cap)")  # fmt: skip
    s.add_argument("--socket-mode", type=_octal_mode, default=0o660,
                   help="permissions of the socket: who may lease (default 0660)")  # fmt: skip
    s.add_argument("--socket-group", type=_group, default=None,
                   help="group of the socket (name or gid; default: the agent's)")  # fmt: skip
    s.add_argument("--allow-uid", type=count(0), action="append", default=None,
                   help="only these peer uids may lease (repeatable; default: any that can connect)")  # fmt: skip
    s.add_argument("--drain-timeout-s", type=float, default=20.0,
                   help="on SIGTERM, how long connected workers are still served (default 20)")  # fmt: skip
    s.add_argument("--cpus", type=_cpus, default=None,
                   help="restrict the agent, its admission limit and pinning to these CPUs (e.g. 8-63)")  # fmt: skip
    s.set_defaults(func=cmd_serve)

    st = ssub.add_parser("status", help="ask a host agent for its stats (exit 1 if unreachable)")
    st.add_argument("url", nargs="?", default=f"unix://{DEFAULT_SOCKET}", help="unix:///path")
    st.add_argument("--timeout", type=seconds, default=5.0, help="connect timeout in seconds")
    st.add_argument("--json", action="store_true")
    st.set_defaults(func=cmd_status)


def cmd_serve(args: argparse.Namespace) -> int:
    from slipstream.cli.sandbox_args import sandbox_failure, sandbox_template
    from slipstream.sandbox.errors import SandboxError
    from slipstream.sandbox.host_agent import HostAgent
    from slipstream.sandbox.journal import default_state_dir
    from slipstream.sandbox.pool import PoolOptions

    cfg, tmpl = sandbox_template(args)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if args.max_wait_s < 0 or args.drain_timeout_s < 0:
        print("slipstream sandbox serve: --max-wait-s and --drain-timeout-s must be >= 0",
              file=sys.stderr)  # fmt: skip
        return 2
    if args.cpus is not None:
        try:
            os.sched_setaffinity(0, args.cpus)
        except OSError as e:
            return sandbox_failure(OSError(f"--cpus {args.cpus}: {e}"))
    agent = HostAgent(
        args.socket, tmpl, PoolOptions.from_config(cfg),
        state_dir=cfg.state_dir or default_state_dir(), lease_ttl_s=args.lease_ttl_s,
        max_wait_s=args.max_wait_s, max_waiters=args.max_waiters, socket_mode=args.socket_mode,
        socket_gid=args.socket_group,
        allowed_uids=set(args.allow_uid) if args.allow_uid is not None else None,
    )  # fmt: skip

    async def serve() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await agent.start()
        assert agent.pool is not None
        print(f"slipstream sandbox serve: serving unix://{args.socket} ({tmpl.backend}, "
              f"{agent.pool.admission_state()}, lease ttl {args.lease_ttl_s:g} s)",
              file=sys.stderr, flush=True)  # fmt: skip
        await stop.wait()
        print("slipstream sandbox serve: draining", file=sys.stderr, flush=True)
        await agent.stop(args.drain_timeout_s)

    try:
        asyncio.run(serve())
    except (SandboxError, OSError) as e:
        return sandbox_failure(e)
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from slipstream.cli.sandbox_args import sandbox_failure
    from slipstream.sandbox.agent_pool import AgentPool
    from slipstream.sandbox.errors import SandboxError

    async def ask() -> dict[str, Any]:
        pool = AgentPool(args.url, connect_timeout_s=args.timeout, name="slipstream-status")
        try:
            await pool.start()
            return await pool.agent_stats()
        finally:
            await pool.stop()

    try:
        stats = asyncio.run(ask())
    except (SandboxError, ValueError) as e:
        return sandbox_failure(e)
    if args.json:
        print(json.dumps(stats, indent=2))
        return 0
    p = stats["pool"]
    print(f"{args.url}: {stats['in_use']} leased, {p['idle']} idle, {p['creating']} creating, "
          f"{stats['sessions_open']} clients, {stats['waiting']} waiting; granted "
          f"{stats['leases_granted']}, expired {stats['leases_expired']}, ended on disconnect "
          f"{stats['leases_ended_on_disconnect']}, no capacity {stats['no_capacity']}; "
          f"{stats['admission']}")  # fmt: skip
    return 0
