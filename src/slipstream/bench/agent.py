"""`slipstream bench agent`: the episode endpoint's overhead per model call.

The same --calls chat calls (the task's prompts as one user message, --tokens sampled tokens
each, EOS ignored so every call samples the same count) two ways, in one run, on one native
engine with the config's [model] (random weights):
- baseline: `engine.generate` on the prompt ids, one call after another (what the episode loop
  does for a built-in environment's turn);
- figure: POST /chat/completions to an episode's endpoint (envs/agent_endpoint.py) from an HTTP
  client in this process (httpx, keep-alive), one call after another: the chat template, request
  parsing, the session's checks and recording, JSON out and the HTTP round trip on top of the
  same generation;
- also: the same through the `openai` SDK client (what an agent pays, minus its process start).
The three ways run interleaved, call by call, in a rotating order (a shared host's load falls
on all alike); mean and p50 latency per call, and the overhead per call as the median of the
paired differences (endpoint - direct, same prompt, back to back), in ms.

With --starts N: an agent process's start, the config's `agent.command` (e.g.
examples/agents/calculator_agent.py) run as N whole episodes each way, one at a time,
alternating, through `AgentRuntime.run_agent` against the same endpoint:
- baseline: `agent.preload = []`, a fresh `/bin/sh -c COMMAND` per episode;
- figure: `agent.preload` (the config's, else ["openai"]), a fork of the warm template.
Per episode: start-up wall (the launch to the endpoint's first call) and start-up CPU (the
agent's process group's user+system CPU at that first call, read from /proc: imports, client,
the request), the whole episode's wall, and the template's one-time start (wall, CPU). Medians
and means. --calls 0 skips the per-call part. With --sandbox, a third way: the fresh process
inside the agent sandbox (`agent.sandbox = true`, docs/agents.md "Sandbox"; `sandbox_binds` the
config's, else the script's directory); its start-up CPU is its whole process tree's (bwrap,
the forwarder, the agent: the sandbox's processes lead sessions of their own).

JSON with provenance in benchmarks/results/agent.json (or --out). Not covered: concurrent
episodes, streaming.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path
from typing import Any

from slipstream.config.args import add_config_args


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("agent", help="episode endpoint's overhead per call vs a direct engine call",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    add_config_args(p)
    p.add_argument("--calls", type=int, default=100, help="calls per way")
    p.add_argument("--tokens", type=int, default=16, help="sampled tokens per call")
    p.add_argument("--starts", type=int, default=0,
                   help="agent episodes per way: fresh process vs forked from the warm template")  # fmt: skip
    p.add_argument("--sandbox", action="store_true",
                   help="with --starts: also a fresh process inside the agent sandbox (bwrap)")  # fmt: skip
    p.add_argument("--out", default="benchmarks/results/agent.json", help="JSON output path")
    p.set_defaults(func=run)


def _stats(seconds: list[float]) -> dict[str, float]:
    return {"mean_ms": 1e3 * statistics.fmean(seconds),
            "p50_ms": 1e3 * statistics.median(seconds)}  # fmt: skip


def _paired(a: list[float], b: list[float]) -> float:
    """Median of the per-call differences a - b, in ms (same prompt, back to back)."""
    return 1e3 * statistics.median(x - y for x, y in zip(a, b, strict=True))


def run(args: argparse.Namespace) -> int:
    import torch

    from slipstream.config import load_config
    from slipstream.engine import build_engine
    from slipstream.model import MoEForCausalLM
    from slipstream.observe.provenance import collect_provenance, write_result
    from slipstream.tasks import get_taskset

    cfg = load_config(args.config, args.overrides)
    ts = get_taskset(cfg.task)
    tok = ts.tokenizer
    torch.manual_seed(0)
    model = MoEForCausalLM(cfg.model.model_copy(update={"vocab_size": tok.vocab_size})).eval()
    engine = build_engine(cfg.engine, model, tokenizer=tok)
    load_before = os.getloadavg()
    record: dict[str, Any] = {"benchmark": "agent"}
    try:
        if args.calls > 0:
            record.update(_per_call(args, engine, ts))
        if args.starts > 0:
            record["agent_start"] = _starts(args, cfg, engine, ts)
    finally:
        engine.close()
    record["params"] = sum(p.numel() for p in model.parameters())
    record["provenance"] = collect_provenance(
        {"loadavg_1_5_15": os.getloadavg(), "loadavg_before_1_5_15": load_before}
    )
    path = write_result(args.out, record)
    print(f"load average (1, 5, 15 min): before {load_before}, after {os.getloadavg()}")
    print(f"wrote {path}")
    return 0


def _per_call(args: argparse.Namespace, engine: Any, ts: Any) -> dict[str, Any]:
    import httpx
    from openai import OpenAI

    from slipstream.engine.base import GenerateRequest, SamplingParams
    from slipstream.envs.agent_endpoint import AgentEndpoint

    tok = ts.tokenizer
    tasks = ts.train_batch(0, args.calls)
    messages = [[{"role": "user", "content": t.prompt}] for t in tasks]
    params = SamplingParams(temperature=1.0, max_new_tokens=args.tokens, ignore_eos=True)
    endpoint = AgentEndpoint(engine, tok, max_turn_tokens=args.tokens,
                             context_tokens=engine.max_seq_len)  # fmt: skip
    try:
        session = endpoint.open(max_calls=3 * args.calls + 2, max_sampled_tokens=1 << 30)
        body: dict[str, Any] = {"model": "policy", "max_tokens": args.tokens, "ignore_eos": True}
        url = f"{session.base_url}/chat/completions"
        auth = {"Authorization": f"Bearer {session.api_key}"}
        client = OpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0)
        with httpx.Client(timeout=60) as http:

            def way_direct(m: list[dict[str, str]]) -> None:
                (c,) = engine.generate([GenerateRequest(tok.chat_prompt(m), params)])
                assert len(c.token_ids) == args.tokens

            def way_httpx(m: list[dict[str, str]]) -> None:
                r = http.post(url, headers=auth, json={**body, "messages": m})
                assert r.status_code == 200, r.text

            def way_sdk(m: list[dict[str, str]]) -> None:
                client.chat.completions.create(model="policy", messages=m,  # type: ignore[arg-type]
                                               max_tokens=args.tokens,
                                               extra_body={"ignore_eos": True})  # fmt: skip

            ways = [way_direct, way_httpx, way_sdk]
            times: list[list[float]] = [[], [], []]
            for w in ways:  # warm-up: first forward, connection, the SDK's first request
                w(messages[0])
            # interleaved, the order rotating per call, so a shared host's load hits every way
            # alike; medians and paired differences are what the run reports
            for i, m in enumerate(messages):
                for k in range(3):
                    j = (i + k) % 3
                    t0 = time.perf_counter()
                    ways[j](m)
                    times[j].append(time.perf_counter() - t0)
        direct, served, sdk = times
        recorded = len(session.calls)
        session.close()
    finally:
        endpoint.close()
    d, s, o = _stats(direct), _stats(served), _stats(sdk)
    print(f"per call, {args.calls} calls of {args.tokens} tokens (mean / p50 ms):")
    print(f"  direct engine.generate    {d['mean_ms']:8.2f} / {d['p50_ms']:8.2f}   (baseline)")
    print(f"  endpoint, httpx           {s['mean_ms']:8.2f} / {s['p50_ms']:8.2f}   "
          f"overhead (median of paired differences) {_paired(served, direct):+.2f} ms")  # fmt: skip
    print(f"  endpoint, openai SDK      {o['mean_ms']:8.2f} / {o['p50_ms']:8.2f}   "
          f"overhead (median of paired differences) {_paired(sdk, direct):+.2f} ms")  # fmt: skip
    return {
        "figure": {"name": "episode endpoint (httpx, keep-alive), per call", **s},
        "baseline": {"name": "engine.generate, per call", **d},
        "openai_sdk": {"name": "episode endpoint through the openai SDK, per call", **o},
        "overhead_ms": {"httpx_median_paired": _paired(served, direct),
                        "openai_sdk_median_paired": _paired(sdk, direct)},
        "calls": args.calls, "tokens_per_call": args.tokens, "recorded_calls": recorded,
    }  # fmt: skip


_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def _stat(path: Path) -> list[str]:
    """/proc/PID/stat's fields after the command name: [0] state, [1] ppid, [2] pgrp,
    [11:15] utime stime cutime cstime (ticks)."""
    return path.read_text().rsplit(") ", 1)[1].split()


def _processes() -> dict[int, tuple[int, int, int]]:
    """Every live process: pid -> (ppid, pgrp, CPU ticks: its own and its reaped children's)."""
    out = {}
    for path in Path("/proc").glob("[0-9]*/stat"):
        try:
            f = _stat(path)
        except (OSError, IndexError):  # it exited while listed
            continue
        out[int(path.parent.name)] = (int(f[1]), int(f[2]), sum(int(x) for x in f[11:15]))
    return out


def _group_cpu_s(pgid: int) -> float:
    """User + system CPU of the processes in group `pgid` (theirs and their reaped children's),
    from /proc."""
    return sum(t for _, g, t in _processes().values() if g == pgid) * _TICK_S


def _tree_cpu_s(pid: int) -> float:
    """User + system CPU of `pid` and its descendants (theirs and their reaped children's)."""
    procs = _processes()
    total = 0
    for p, (_, _, ticks) in procs.items():
        q = p
        while q in procs and q != pid:
            q = procs[q][0]
        if q == pid:
            total += ticks
    return total * _TICK_S


def _own_cpu_s(pid: int) -> float:
    return sum(int(x) for x in _stat(Path(f"/proc/{pid}/stat"))[11:15]) * _TICK_S


class _FirstCall:
    """The engine, noting the first call after `arm(pgid)`: when, and its group's CPU then."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.pgid = 0
        self.tree = False
        self.at: tuple[float, float] | None = None

    @property
    def version(self) -> int:
        return self.engine.version

    def arm(self, pgid: int, tree: bool = False) -> None:
        """`tree`: count the CPU of the process tree under `pgid`'s leader, not the group's."""
        self.pgid, self.tree, self.at = pgid, tree, None

    def submit(self, request: Any) -> Any:
        if self.at is None and self.pgid:
            cpu = _tree_cpu_s(self.pgid) if self.tree else _group_cpu_s(self.pgid)
            self.at = (time.monotonic(), cpu)
        return self.engine.submit(request)

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)


class _Noting:
    """A Launcher that notes each start's time and arms `_FirstCall` with the run's group."""

    def __init__(self, inner: Any, first: _FirstCall, tree: bool = False) -> None:
        self.inner, self.first, self.tree = inner, first, tree
        self.started_at = 0.0

    def start(self, **kw: Any) -> Any:
        self.started_at = time.monotonic()
        proc = self.inner.start(**kw)
        self.first.arm(proc.pid, self.tree)
        return proc

    def finish(self, proc: Any) -> Any:
        return self.inner.finish(proc)

    def close(self) -> None:
        self.inner.close()


def _starts(args: argparse.Namespace, cfg: Any, engine: Any, ts: Any) -> dict[str, Any]:
    from slipstream.envs import EpisodeLimits
    from slipstream.envs.agent import AgentRuntime
    from slipstream.envs.agent_launch import ForkLauncher

    preload = cfg.agent.preload or ["openai"]
    plain = cfg.agent.model_copy(update={"sandbox": False, "sandbox_binds": []})
    agents = {"fresh process": plain.model_copy(update={"preload": []})}
    from slipstream.config.agent import AgentConfig, python_command

    try:  # a warm start only for a `{python} SCRIPT` command (a shell agent has none)
        python_command(cfg.agent.command)
        agents["forked (preload)"] = plain.model_copy(update={"preload": preload})
    except ValueError:
        preload = []
    if args.sandbox:
        binds = cfg.agent.sandbox_binds
        if not binds:  # the script's directory (a `{python} SCRIPT` command)
            try:
                binds = [os.path.dirname(python_command(cfg.agent.command).script or "")]
            except ValueError:
                raise SystemExit("bench agent --sandbox: set agent.sandbox_binds (and "
                                 "agent.sandbox = true) for this command") from None  # fmt: skip
        agents["sandboxed (bwrap)"] = AgentConfig.model_validate(
            {**cfg.agent.model_dump(), "preload": [], "sandbox": True, "sandbox_binds": binds}
        )
    limits = EpisodeLimits(max_turns=cfg.rollout.max_turns,
                           max_turn_tokens=cfg.rollout.max_new_tokens)  # fmt: skip
    first = _FirstCall(engine)
    runtimes: dict[str, Any] = {}
    template: dict[str, float] = {}
    rows: dict[str, list[tuple[float, float, float]]] = {k: [] for k in agents}
    try:
        for name, acfg in agents.items():
            t0 = time.monotonic()
            rt = AgentRuntime(first, ts, acfg, limits, context_tokens=engine.max_seq_len)  # type: ignore[arg-type]
            runtimes[name] = rt
            if isinstance(rt.launcher, ForkLauncher):  # its imports are done when it answers
                template = {"wall_s": time.monotonic() - t0,
                            "cpu_s": _own_cpu_s(rt.launcher.template_pid)}  # fmt: skip
            rt.launcher = _Noting(rt.launcher, first, tree=acfg.sandbox)
        tasks = ts.train_batch(0, args.starts)
        for i, task in enumerate(tasks):
            for name in list(agents) if i % 2 == 0 else list(agents)[::-1]:
                rt = runtimes[name]
                session = rt.endpoint.open(max_calls=rt.max_calls,
                                           max_sampled_tokens=rt.max_sampled_tokens)  # fmt: skip
                out = rt.run_agent(task, session, lambda: False)
                if first.at is None or out.exit_code != 0:
                    raise RuntimeError(f"{name}: the agent made no call or failed "
                                       f"(exit {out.exit_code}): {out.stderr[-500:]}")  # fmt: skip
                at, cpu = first.at
                rows[name].append((at - rt.launcher.started_at, cpu, out.wall_s))
    finally:
        for rt in runtimes.values():
            rt.close()
    result: dict[str, Any] = {"command": cfg.agent.command, "preload": preload,
                              "episodes_per_way": args.starts, "template_start": template}  # fmt: skip
    print(f"agent start, {args.starts} episodes each way of {cfg.agent.command!r} (median / mean):")
    for name, r in rows.items():
        wall, cpu, episode = ([x[k] for x in r] for k in range(3))
        result[name] = {
            "startup_wall_s": {"p50": statistics.median(wall), "mean": statistics.fmean(wall)},
            "startup_cpu_s": {"p50": statistics.median(cpu), "mean": statistics.fmean(cpu)},
            "episode_wall_s": {"p50": statistics.median(episode),
                               "mean": statistics.fmean(episode)},
        }  # fmt: skip
        print(f"  {name:17s} start-up wall {statistics.median(wall):6.3f} / "
              f"{statistics.fmean(wall):6.3f} s   start-up CPU {statistics.median(cpu):6.3f} / "
              f"{statistics.fmean(cpu):6.3f} s   episode wall {statistics.median(episode):6.3f} s")  # fmt: skip
    if template:
        print(f"  template (once): {template['wall_s']:.2f} s wall, {template['cpu_s']:.2f} s CPU "
              f"importing {preload}")  # fmt: skip
    return result
