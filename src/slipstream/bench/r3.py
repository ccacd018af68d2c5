"""`slipstream bench r3`: the train-inference mismatch of MoE routing, with and without rollout
routing replay (R3), at several staleness bounds, in one run.

For each --staleness bound S (default 0, 2, 4) and each of routing_replay = off / r3, the real
job (trainer here, rollout worker processes recording routing, trainer.mode = async with
buffer.max_staleness = S, the router trained) runs --steps steps from the same start checkpoint
(--init, model.init_from, the quickstart's SFT checkpoint if complete, else a random init), and
reports over the steps (sample-weighted means of the per-step metrics, by token staleness
0 / 1 / 2+):
- router agreement: fraction of (position, MoE layer) whose trainer top-k (live router) equals
  the top-k the engine recorded,
- |trainer logp - behaviour logp| of sampled tokens (the trainer's logp at the proximal weights,
  with the replayed routing under r3),
- the k3 estimate of KL(behaviour || trainer),
- final mean batch reward (last third of the steps).
The figure is R3's logp mismatch at the largest bound, the baseline the same without R3; the
"limit" is 0 (no mismatch). JSON with provenance: benchmarks/results/r3.json (or --out).

Not covered: GPU engines (whose numerics differ from the trainer's far more than here: on this
CPU both run the same fp32 kernels, so at staleness 0 the mismatch is float rounding only).
"""

from __future__ import annotations

import argparse
import logging
import tempfile
import time
from pathlib import Path
from typing import Any

from slipstream.bench.pipeline import start_checkpoint
from slipstream.config.args import add_config_args

METRICS = ("router_agreement", "logp_abs_diff", "k3_kl")
BUCKETS = ("s0", "s1", "s2+")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("r3", help="MoE routing mismatch with and without routing replay",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    add_config_args(p)
    p.add_argument("--staleness", default="0,2,4", help="comma list of buffer.max_staleness")
    p.add_argument("--steps", type=int, default=60, help="trainer steps per setting")
    p.add_argument("--workers", type=int, default=1, help="rollout worker processes")
    p.add_argument("--init", default=None, help="start checkpoint (see the description)")
    p.add_argument("--out", default="benchmarks/results/r3.json", help="JSON output path")
    p.set_defaults(func=run)


def _summary(records: list[dict[str, Any]]) -> dict[str, float]:
    """Sample-weighted means over the steps of each metric that appeared."""
    out: dict[str, float] = {}
    for metric in METRICS:
        for suffix in ("", *(f"_{b}" for b in BUCKETS)):
            key = metric + suffix
            vals = [(r[key], r["num_samples"]) for r in records if key in r]
            if vals:
                out[key] = sum(v * n for v, n in vals) / sum(n for _, n in vals)
    tail = records[-max(1, len(records) // 3) :]
    out["final_reward"] = sum(r["reward_mean"] for r in tail) / len(tail)
    return out


def run(args: argparse.Namespace) -> int:
    from slipstream.bench.pipeline import run_mode
    from slipstream.config import load_config
    from slipstream.observe.provenance import collect_provenance, write_result

    logging.basicConfig(level=logging.WARNING)
    bounds = [int(s) for s in args.staleness.split(",")]
    rows: list[dict[str, Any]] = []
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-r3-") as tmp_s:
        tmp = Path(tmp_s)
        base = load_config(args.config, args.overrides)
        init, init_kind = start_checkpoint(base, args.init, tmp)
        for bound in bounds:
            for replay in ("off", "r3"):
                name = f"s{bound}-{replay}"
                overrides = [
                    *args.overrides, "trainer.mode=async", f"buffer.max_staleness={bound}",
                    f"trainer.routing_replay={replay}", "rollout.record_routing=true",
                    "trainer.freeze_router=false", f"trainer.steps={args.steps}",
                    f"rollout.num_workers={args.workers}", f"run.output_dir={tmp / name}",
                    f"store.url={tmp / name / 'store'}", "trainer.checkpoint_every=0",
                    "trainer.eval_every=0",
                ]  # fmt: skip
                cfg = load_config(args.config, overrides)
                t0 = time.monotonic()
                result = run_mode(cfg, init)
                steps = result.pop("records")
                rows.append({"max_staleness": bound, "routing_replay": replay,
                             "samples_per_s": result["samples_per_s"], **_summary(steps),
                             "pass_at_1_before": result["pass_at_1_before"],
                             "pass_at_1_after": result["pass_at_1_after"]})  # fmt: skip
                print(f"{name}: {time.monotonic() - t0:.0f} s", flush=True)
    header = (f"{'S':>2} {'replay':>6} | {'agree':>6} {'agree s0':>8} {'agree s2+':>9} | "
              f"{'|dlogp|':>8} {'s0':>8} {'s1':>8} {'s2+':>8} | {'k3 KL':>8} | {'reward':>6}")  # fmt: skip
    print(header)
    print("-" * len(header))

    def f(r: dict[str, Any], key: str, width: int = 8, fmt: str = ".4f") -> str:
        return f"{r[key]:>{width}{fmt}}" if key in r else f"{'-':>{width}}"

    for r in rows:
        print(f"{r['max_staleness']:>2} {r['routing_replay']:>6} | "
              f"{f(r, 'router_agreement', 6, '.3f')} {f(r, 'router_agreement_s0', 8, '.3f')} "
              f"{f(r, 'router_agreement_s2+', 9, '.3f')} | {f(r, 'logp_abs_diff')} "
              f"{f(r, 'logp_abs_diff_s0')} {f(r, 'logp_abs_diff_s1')} {f(r, 'logp_abs_diff_s2+')}"
              f" | {f(r, 'k3_kl', 8, '.2e')} | {r['final_reward']:>6.3f}")  # fmt: skip
    top = max(bounds)
    off = next(r for r in rows if r["max_staleness"] == top and r["routing_replay"] == "off")
    on = next(r for r in rows if r["max_staleness"] == top and r["routing_replay"] == "r3")
    record = {
        "benchmark": "r3",
        "figure": {"name": f"R3 mean |logp - behaviour| at max_staleness {top}",
                   "value": on.get("logp_abs_diff")},
        "baseline": {"name": f"no replay, max_staleness {top}", "value": off.get("logp_abs_diff")},
        "limit": {"name": "no mismatch", "value": 0.0},
        "rows": rows,
        "start_checkpoint": {"path": init, "kind": init_kind},
        "steps": args.steps,
        "config": base.model_dump(mode="json"),
        "provenance": collect_provenance(),
    }  # fmt: skip
    out = write_result(args.out, record)
    print(f"\nfigure R3 |dlogp| {on.get('logp_abs_diff', float('nan')):.4f} | baseline "
          f"{off.get('logp_abs_diff', float('nan')):.4f} | limit 0 (max_staleness {top}); "
          f"wall {time.perf_counter() - t_start:.0f} s\nwrote {out}")  # fmt: skip
    return 0
