"""`slipstream bench moe-experts`: the MoE layer's expert computation, grouped vs per-expert loop.

For each shape (N tokens, D hidden, I expert width, E experts, top-k) it times one SparseMoeBlock
forward, and forward+backward, with each expert path on identical weights and inputs:
- figure: "grouped" (sort by expert, one matmul per non-empty expert segment; the default path),
- baseline: "loop" (reference per-expert masked loop, as transformers),
- also "grouped_mm" (torch._grouped_mm, where it runs),
- limit: "dense-equivalent" - the same FLOPs as two plain matmuls over all N*k assignments
  (what a perfect grouped kernel with zero routing overhead would cost).
Prints median ms and the ratios loop/grouped (speedup) and grouped/limit (overhead), and writes
JSON with provenance to benchmarks/results/moe_experts.json (or --out).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

from slipstream.config.model import MOE_IMPLS

# (tokens, hidden, expert_width, experts, top_k): the quickstart layer, then wider/sparser ones
DEFAULT_SHAPES = [
    (512, 128, 128, 8, 2),
    (2048, 128, 128, 8, 2),
    (2048, 256, 128, 16, 2),
    (512, 256, 128, 64, 8),
    (2048, 256, 128, 64, 8),
]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "moe-experts",
        help="MoE expert compute: grouped vs per-expert loop (median ms, speedup)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--shape",
        action="append",
        default=None,
        metavar="N,D,I,E,K",
        help="tokens,hidden,expert_width,experts,top_k (repeatable; default: 5 built-in shapes)",
    )
    p.add_argument("--device", default="cpu", help="torch device (default cpu)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    p.add_argument("--reps", type=int, default=10, help="timed repetitions per case (median)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--out", default="benchmarks/results/moe_experts.json", help="JSON output path")
    p.set_defaults(func=run)


def _time_interleaved_ms(
    fns: dict[str, Callable[[], None]], reps: int, warmup: int, sync: Callable[[], None]
) -> dict[str, float]:
    """Median ms per function. The functions take turns within every repetition, so load from
    other processes on a shared machine hits all of them alike."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    sync()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            sync()
            samples[name].append((time.perf_counter() - t0) * 1e3)
    return {name: statistics.median(v) for name, v in samples.items()}


def _bench_shape(
    shape: tuple[int, int, int, int, int], device: str, dtype: Any, reps: int, warmup: int
) -> list[dict[str, Any]]:
    import torch
    import torch.nn.functional as F

    from slipstream.model.moe_block import SparseMoeBlock, grouped_mm_unavailable

    n, d, i, e, k = shape
    torch.manual_seed(0)
    # one block per path, identical weights
    blocks = {}
    for impl in MOE_IMPLS:
        torch.manual_seed(0)
        block = SparseMoeBlock(d, e, k, i, norm_topk_prob=True, impl=impl)
        for p in block.parameters():
            torch.nn.init.normal_(p, std=0.05)
        blocks[impl] = block.to(device=device, dtype=dtype)
    x = torch.randn(1, n, d, device=device, dtype=dtype)
    xg = x.detach().clone().requires_grad_(True)
    if grouped_mm_unavailable(x.device, x.dtype, (d, i)) is not None:
        del blocks["grouped_mm"]
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    # dense-equivalent limit: the same matmul FLOPs over N*k rows, no routing
    xa = torch.randn(n * k, d, device=device, dtype=dtype, requires_grad=True)
    w1 = torch.randn(2 * i, d, device=device, dtype=dtype, requires_grad=True)
    w2 = torch.randn(d, i, device=device, dtype=dtype, requires_grad=True)

    def dense() -> torch.Tensor:
        gate, up = F.linear(xa, w1).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, w2)

    def fwd(fn: Callable[[], Any]) -> Callable[[], None]:
        def step() -> None:
            with torch.no_grad():
                fn()

        return step

    def fwd_bwd(fn: Callable[[], Any]) -> Callable[[], None]:
        def step() -> None:
            out = fn()
            out = out[0] if isinstance(out, tuple) else out
            out.float().square().mean().backward()

        return step

    rows: list[dict[str, Any]] = []
    for mode, wrap in (("fwd", fwd), ("fwd_bwd", fwd_bwd)):
        fns = {impl: wrap(lambda b=b: b(xg)) for impl, b in blocks.items()}
        fns["limit"] = wrap(dense)
        ms = _time_interleaved_ms(fns, reps, warmup, sync)
        gmm = ms.get("grouped_mm")
        rows.append(
            {
                "tokens": n,
                "hidden": d,
                "expert_width": i,
                "experts": e,
                "top_k": k,
                "mode": mode,
                "grouped_ms": ms["grouped"],
                "grouped_mm_ms": gmm,
                "loop_ms": ms["loop"],
                "dense_equiv_limit_ms": ms["limit"],
                "speedup_vs_loop": ms["loop"] / ms["grouped"],
                "grouped_mm_speedup_vs_loop": None if gmm is None else ms["loop"] / gmm,
                "overhead_vs_limit": ms["grouped"] / ms["limit"],
            }
        )
    return rows


def _fmt(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.2f}"


def run(args: argparse.Namespace) -> int:
    import torch

    from slipstream.model import moe_block as moe
    from slipstream.observe.provenance import collect_provenance, write_result

    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    shapes = (
        [tuple(int(v) for v in s.split(",")) for s in args.shape] if args.shape else DEFAULT_SHAPES
    )
    for s in shapes:
        if len(s) != 5:
            raise SystemExit(f"--shape {s!r}: expected N,D,I,E,K (5 integers)")
    rows: list[dict[str, Any]] = []
    header = (
        f"{'N':>5} {'D':>4} {'I':>4} {'E':>3} {'k':>2} {'mode':>7} | {'grouped':>8} "
        f"{'gmm':>8} {'loop':>8} {'limit':>8} | {'speedup':>7} {'gmm_sp':>6} {'vs_lim':>6}"
    )
    print("MoE expert compute, median ms (figure=grouped, baseline=loop, limit=dense-equivalent)")
    print(header)
    print("-" * len(header))
    for shape in shapes:
        for r in _bench_shape(shape, args.device, dtype, args.reps, args.warmup):  # type: ignore[arg-type]
            rows.append(r)
            print(
                f"{r['tokens']:>5} {r['hidden']:>4} {r['expert_width']:>4} {r['experts']:>3} "
                f"{r['top_k']:>2} {r['mode']:>7} | {r['grouped_ms']:>8.2f} "
                f"{_fmt(r['grouped_mm_ms']):>8} {r['loop_ms']:>8.2f} "
                f"{r['dense_equiv_limit_ms']:>8.2f} | {r['speedup_vs_loop']:>6.2f}x "
                f"{_fmt(r['grouped_mm_speedup_vs_loop']):>5}x {r['overhead_vs_limit']:>5.2f}x",
                flush=True,
            )
    result = {
        "benchmark": "moe_experts",
        "figure": "grouped_ms",
        "baseline": "loop_ms",
        "limit": "dense_equiv_limit_ms",
        "settings": {
            "device": args.device,
            "dtype": args.dtype,
            "threads": args.threads,
            "reps": args.reps,
            "warmup": args.warmup,
        },
        "results": rows,
        "fallbacks": list(moe.fallbacks),
        "provenance": collect_provenance({"command": "slipstream bench moe-experts"}),
    }
    out = write_result(args.out, result)
    print(f"wrote {out}")
    return 0
