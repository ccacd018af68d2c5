"""`slipstream bench moe-dispatch`: EP dispatch/combine, padded vs exact vs hierarchical.

Spawns num_nodes x ranks_per_node gloo processes on this machine (default 2 simulated nodes x 2
ranks; see docs/moe-ep.md) and, per config (N tokens PER RANK, D hidden, E experts, top-k) with
uniform random routing, runs every dispatcher on the same inputs:
- figure: inter-node bytes per call of `hierarchical` relative to `exact` (all ranks summed,
  payload + metadata, measured from the actual split sizes),
- baseline: `exact` (exact-split all-to-all, one copy per (token, expert)),
- limit: the cost model g (1 - C(E - E/g, k) / C(E, k)) / k - the payload ratio node-aware
  dispatch reaches under uniform routing (metadata excluded),
- also: dispatch/combine median ms (max over ranks per repetition), intra/inter/self bytes,
  `padded`'s bytes and drop fraction at --capacity-factor.
Timings here are gloo over loopback on a shared 2-core CPU: noise-dominated and not indicative of
NVLink/EFA; the byte counts are the meaningful figure. DeepEP's published H800 figures from
reference/anchors.md are printed beside for context only (different hardware class).
Before timing, every dispatcher is checked against the single-process reference MoE (fwd+bwd).
JSON with provenance goes to benchmarks/results/moe_dispatch.json (or --out).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

# (tokens per rank, hidden, experts, top_k)
DEFAULT_CONFIGS = [(1024, 256, 16, 2), (2048, 512, 32, 4), (4096, 1024, 64, 8)]
TYPES = ("padded", "exact", "hierarchical")

# reference/anchors.md, "Expert-parallel communication": DeepEP normal kernels on H800 (NVLink
# ~160 GB/s, CX7 400 Gb/s RDMA per GPU), 4096 tokens, hidden 7168, top-8 of 256, FP8 dispatch /
# BF16 combine. Bandwidths in GB/s.
DEEPEP_REFERENCE = {
    "source": "reference/anchors.md (DeepEP normal kernels, H800 + CX7 400 Gb/s; NOT this host)",
    "setting": "4096 tokens, hidden 7168, top-8 of 256 experts, FP8 dispatch, BF16 combine",
    "rows": [
        {"ep": 8, "link": "NVLink", "dispatch_GBps": 153, "combine_GBps": 158},
        {"ep": 16, "link": "RDMA", "dispatch_GBps": 43, "combine_GBps": 43},
        {"ep": 32, "link": "RDMA", "dispatch_GBps": 58, "combine_GBps": 57},
        {"ep": 64, "link": "RDMA", "dispatch_GBps": 51, "combine_GBps": 50},
    ],
    "low_latency_us": "128 tokens: EP8 77 / 114, EP64 173 / 314, EP256 194 / 360 (dispatch / "
    "combine); DeepEP V2 on 2 x p5en (EFA, decode): ~279 / ~344",
}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "moe-dispatch",
        help="MoE expert-parallel dispatch/combine: inter-node bytes and ms per dispatcher",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--config",
        action="append",
        default=None,
        metavar="N,D,E,K",
        help="tokens_per_rank,hidden,experts,top_k (repeatable; default: 3 built-in configs)",
    )
    p.add_argument("--nodes", type=int, default=2, help="simulated nodes (default 2)")
    p.add_argument("--ranks-per-node", type=int, default=2, help="ranks per node (default 2)")
    p.add_argument("--capacity-factor", type=float, default=1.25, help="padded dispatcher")
    p.add_argument("--reps", type=int, default=5, help="timed repetitions (median)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="benchmarks/results/moe_dispatch.json", help="JSON output")
    p.set_defaults(func=run)


def _worker(
    group: Any,
    configs: list[tuple[int, int, int, int]],
    reps: int,
    warmup: int,
    cf: float,
    seed: int,
) -> dict[str, Any]:
    """Runs in every rank: correctness check, then per config the timed dispatch/combine loop."""
    import torch
    import torch.distributed as dist

    from slipstream.moe.base import make_dispatcher
    from slipstream.moe.cost_model import random_topk
    from slipstream.moe.meter import ByteMeter
    from slipstream.moe.rank_layout import EPGroup
    from slipstream.moe.selfcheck import reference_check

    check = reference_check(group)
    out: dict[str, Any] = {"check": check, "configs": []}
    t = group.topo
    for n, d, e, k in configs:
        # experts per config: a fresh EPGroup view with this E (same process groups)
        g = EPGroup(
            type(t)(t.num_nodes, t.ranks_per_node, e),
            group.rank,
            group.world,
            group.node_group,
            group.rail_group,
        )
        gen = torch.Generator().manual_seed(seed * 1000 + group.rank)
        ids = random_topk(n, e, k, generator=gen)
        x = torch.randn(n, d, generator=gen)
        w = torch.rand(n, k, generator=gen)
        disps = {
            typ: make_dispatcher(
                typ, g, ByteMeter(), **({"capacity_factor": cf} if typ == "padded" else {})
            )
            for typ in TYPES
        }
        ms: dict[str, dict[str, list[float]]] = {
            typ: {"dispatch": [], "combine": []} for typ in TYPES
        }
        for rep in range(warmup + reps):
            for typ, disp in disps.items():  # interleaved: machine noise hits all alike
                if rep == warmup:
                    disp.meter.reset()
                with torch.no_grad():
                    dist.barrier()
                    t0 = time.perf_counter()
                    recv_x, _, handle = disp.dispatch(x, ids, w)
                    t1 = time.perf_counter()
                    dist.barrier()
                    t2 = time.perf_counter()
                    disp.combine(recv_x, handle)  # identity experts: communication only
                    t3 = time.perf_counter()
                if rep >= warmup:
                    ms[typ]["dispatch"].append((t1 - t0) * 1e3)
                    ms[typ]["combine"].append((t3 - t2) * 1e3)
        out["configs"].append(
            {
                "config": [n, d, e, k],
                "ms": ms,
                "meter": {typ: disp.meter.summary() for typ, disp in disps.items()},
                "padded_dropped": disps["padded"].dropped,  # type: ignore[attr-defined]
                "padded_assigned": disps["padded"].assigned,  # type: ignore[attr-defined]
            }
        )
    return out


def _aggregate(ranks: list[dict[str, Any]], i: int, nodes: int) -> dict[str, Any]:
    """Group-wide figures for config i: bytes per call summed over ranks; ms = median over reps
    of the slowest rank."""
    from slipstream.moe.cost_model import expected_distinct_nodes, predicted_inter_node_ratio

    cfgs = [r["configs"][i] for r in ranks]
    n, d, e, k = cfgs[0]["config"]
    row: dict[str, Any] = {
        "tokens_per_rank": n,
        "hidden": d,
        "experts": e,
        "top_k": k,
        "ranks": len(ranks),
        "nodes": nodes,
        "model_distinct_nodes_per_token": expected_distinct_nodes(e, nodes, k),
        "limit_inter_payload_ratio": predicted_inter_node_ratio(e, nodes, k),
        "dispatchers": {},
    }
    for typ in TYPES:
        dd: dict[str, Any] = {}
        for phase in ("dispatch", "combine"):
            per_rep = zip(*(c["ms"][typ][phase] for c in cfgs), strict=True)
            dd[f"{phase}_ms"] = statistics.median(max(v) for v in per_rep)
            for link in ("inter", "intra", "self"):
                for kind in ("payload", "meta"):
                    dd[f"{phase}_{link}_{kind}_bytes"] = sum(
                        c["meter"][typ][phase][link][kind] for c in cfgs
                    )
                dd[f"{phase}_{link}_bytes"] = (
                    dd[f"{phase}_{link}_payload_bytes"] + dd[f"{phase}_{link}_meta_bytes"]
                )
        row["dispatchers"][typ] = dd
    ex = row["dispatchers"]["exact"]
    for typ in TYPES:
        dd = row["dispatchers"][typ]
        for phase in ("dispatch", "combine"):
            dd[f"{phase}_inter_ratio_vs_exact"] = (
                dd[f"{phase}_inter_bytes"] / ex[f"{phase}_inter_bytes"]
            )
        dd["dispatch_inter_payload_ratio_vs_exact"] = (
            dd["dispatch_inter_payload_bytes"] / ex["dispatch_inter_payload_bytes"]
        )
    assigned = sum(c["padded_assigned"] for c in cfgs)
    row["dispatchers"]["padded"]["dropped_fraction"] = (
        sum(c["padded_dropped"] for c in cfgs) / assigned if assigned else 0.0
    )
    return row


def _mib(b: float) -> str:
    return f"{b / 2**20:8.2f}"


def run(args: argparse.Namespace) -> int:
    from slipstream.moe.launch import spawn_ep
    from slipstream.observe.provenance import collect_provenance, write_result

    configs = (
        [tuple(int(v) for v in c.split(",")) for c in args.config]
        if args.config
        else DEFAULT_CONFIGS
    )
    for c in configs:
        if len(c) != 4:
            raise SystemExit(f"--config {c!r}: expected N,D,E,K (4 integers)")
    world = args.nodes * args.ranks_per_node
    print(
        f"MoE EP dispatch on {args.nodes} simulated nodes x {args.ranks_per_node} ranks (gloo, "
        f"CPU loopback); figure = inter-node bytes vs exact, limit = cost model"
    )
    t0 = time.perf_counter()
    ranks = spawn_ep(
        "slipstream.bench.moe_dispatch:_worker",
        args.nodes,
        args.ranks_per_node,
        8 * world,  # the correctness check's expert count; configs use their own E
        kwargs={
            "configs": configs,
            "reps": args.reps,
            "warmup": args.warmup,
            "cf": args.capacity_factor,
            "seed": args.seed,
        },
        threads=args.threads,
        timeout_s=600,
    )
    check = {
        typ: max(
            max(v for key, v in r["check"][typ].items() if key.endswith(("out", "grad")))
            for r in ranks
        )
        for typ in TYPES
    }
    print(
        "reference check (max abs diff, fwd+bwd vs single-process MoE): "
        + ", ".join(f"{t}={v:.1e}" for t, v in check.items())
    )
    rows = [_aggregate(ranks, i, args.nodes) for i in range(len(configs))]
    header = (
        f"{'N/rank':>6} {'D':>5} {'E':>3} {'k':>2} {'dispatcher':>12} | {'disp_ms':>8} "
        f"{'comb_ms':>8} | {'inter MiB':>9} {'intra MiB':>9} | {'inter/exact':>11} "
        f"{'payload':>7} {'limit':>6} | drops"
    )
    print(header)
    print("-" * len(header))
    for row in rows:
        for typ in TYPES:
            dd = row["dispatchers"][typ]
            drops = f"{dd['dropped_fraction']:.1%}" if typ == "padded" else ""
            print(
                f"{row['tokens_per_rank']:>6} {row['hidden']:>5} {row['experts']:>3} "
                f"{row['top_k']:>2} {typ:>12} | {dd['dispatch_ms']:>8.2f} {dd['combine_ms']:>8.2f}"
                f" | {_mib(dd['dispatch_inter_bytes']):>9} {_mib(dd['dispatch_intra_bytes']):>9}"
                f" | {dd['dispatch_inter_ratio_vs_exact']:>10.3f}x "
                f"{dd['dispatch_inter_payload_ratio_vs_exact']:>6.3f}x "
                f"{row['limit_inter_payload_ratio']:>5.3f}x | {drops}"
            )
        print(
            f"{'':>20} cost model: {row['model_distinct_nodes_per_token']:.3f} distinct nodes per "
            f"token (of {args.nodes}); bytes are per dispatch call, all ranks summed"
        )
    print(
        f"(timings: shared 2-core CPU, gloo loopback - noise-dominated; bytes are the figure;"
        f" wall {time.perf_counter() - t0:.0f} s)"
    )
    print(f"context only - {DEEPEP_REFERENCE['source']}: {DEEPEP_REFERENCE['setting']}")
    for r in DEEPEP_REFERENCE["rows"]:
        print(
            f"  EP{r['ep']:<3} {r['link']:<6} dispatch {r['dispatch_GBps']} GB/s, "
            f"combine {r['combine_GBps']} GB/s"
        )
    print(f"  low-latency: {DEEPEP_REFERENCE['low_latency_us']} us")
    result = {
        "benchmark": "moe_dispatch",
        "figure": "dispatchers.hierarchical.dispatch_inter_ratio_vs_exact",
        "baseline": "dispatchers.exact (ratio 1.0)",
        "limit": "limit_inter_payload_ratio (cost model, payload only)",
        "note": "timings are gloo over loopback on a shared CPU (noise-dominated); simulated nodes",
        "settings": {
            "nodes": args.nodes,
            "ranks_per_node": args.ranks_per_node,
            "capacity_factor": args.capacity_factor,
            "reps": args.reps,
            "warmup": args.warmup,
            "threads_per_rank": args.threads,
            "routing": "uniform random top-k",
            "dtype": "float32",
        },
        "reference_check_max_abs_diff": check,
        "results": rows,
        "deepep_reference_different_hardware": DEEPEP_REFERENCE,
        "provenance": collect_provenance({"command": "slipstream bench moe-dispatch"}),
    }
    out = write_result(args.out, result)
    print(f"wrote {out}")
    return 0
