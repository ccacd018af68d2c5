"""`slipstream bench weights`: publish -> every engine serving a new weight version, through the
store vs over the wire (engine.weight_sync = store | distributed), with 1, 2, 4 engines.

Every engine is a real `slipstream serve` process on loopback holding the model (--shape
quickstart, larger, or mid: 0.91B parameters, 3.6 GB in fp32, 1.8 GB with --run.dtype=bfloat16,
the dtype the model, the engines and the raw broadcast then use; fp32 at `mid` needs ~10 GB per
engine while a version is applied, bf16 about half). Per engine count and repeat, one new
version (fresh random values, so nothing is cached) is timed from "the trainer has the tensors"
to "every engine answered that it serves it":
- store: `WeightStore.publish` (safetensors + manifest, what the trainer's publisher writes),
  then every engine told to load it (`/update_weights_from_disk`, concurrently): the store path
  of an HTTP engine.
- distributed: `DistributedSender.send` of what the RL job pushes, the stacked expert tensors
  (the engine's own layout), in requests of at most engine.weight_bucket_bytes sent as
  engine.weight_bucket_format (per-tensor broadcasts by default) over one gloo group; the
  group is opened before timing.
- raw broadcast (the limit): the same bucket sizes broadcast over a gloo group of the same
  number of plain receiver processes that do nothing with them, in the same run.
Prints bytes, seconds (median of --repeats), GB/s and distributed vs store / vs raw; JSON with
provenance (CPU model, load average) in benchmarks/results/weights.json (or --out).

Not covered: NCCL and CUDA IPC (engine.weight_sync = colocated): no GPU here (docs/gpu.md).
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from slipstream.config.args import add_config_args


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("weights", help="publish -> served: store vs distributed weight sync",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    add_config_args(p)
    p.add_argument(
        "--shape",
        default="quickstart",
        choices=("quickstart", "larger", "mid"),
        help="model preset (bench/models.py)",
    )
    p.add_argument("--engines", default="1,2,4", help="comma list of engine process counts")
    p.add_argument("--repeats", type=int, default=3, help="versions timed per setting")
    p.add_argument("--out", default="benchmarks/results/weights.json", help="JSON output path")
    p.set_defaults(func=run)


def _model(cfg: Any, shape: str) -> tuple[dict[str, Any], dict[str, Any], Any]:
    import torch

    from slipstream.bench.models import MODELS, VOCAB
    from slipstream.model import MoEForCausalLM, hf_weights
    from slipstream.tasks import get_taskset

    vocab = VOCAB.get(shape) or get_taskset(cfg.task).tokenizer.vocab_size
    mcfg = type(cfg.model).model_validate(
        {**cfg.model.model_dump(), **MODELS[shape], "vocab_size": vocab}
    )  # validated (model_copy(update=) is not): nested keys such as rope_scaling
    torch.manual_seed(0)
    with torch.no_grad():
        # the engines serve run.dtype too
        model = MoEForCausalLM(mcfg).to(getattr(torch, cfg.run.dtype))
    state, config = hf_weights(model)
    return state, config, model


def _fresh(state: dict[str, Any], seed: int) -> dict[str, Any]:
    """New values for every tensor (in place: no second copy of a 3.6 GB model)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t in state.values():
            t.normal_(0.0, 0.02, generator=g)
    return state


def _start_engines(n: int, model_dir: Path, tmp: Path,
                   dtype: str) -> tuple[list[subprocess.Popen], list[str]]:  # fmt: skip
    import httpx

    from slipstream.engine.weight_transport import free_port

    (tmp / "empty.toml").write_text("")
    procs, urls = [], []
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for i in range(n):
        port = free_port()
        log = open(tmp / f"engine{i}.log", "wb")  # noqa: SIM115 - closed with the process
        procs.append(subprocess.Popen(
            [sys.executable, "-c", "from slipstream.cli import main; raise SystemExit(main())",
             "serve", "--model", str(model_dir), "--port", str(port), "-c", str(tmp / "empty.toml"),
             "--engine.max_seq_len=64", "--engine.kv_cache_tokens=256", "--engine.max_batch_size=4",
             "--engine.weight_sync_timeout_s=600", f"--engine.dtype={dtype}"],
            stdout=log, stderr=subprocess.STDOUT, env=env))  # fmt: skip
        urls.append(f"http://127.0.0.1:{port}")
    deadline = time.monotonic() + 600
    for proc, url, i in zip(procs, urls, range(n), strict=True):
        while True:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"engine {i} exited: {(tmp / f'engine{i}.log').read_text()[-2000:]}"
                )
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"engine {i} at {url} did not come up in 600 s")
            time.sleep(0.2)
    return procs, urls


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.terminate()
    for p in procs:
        p.wait(timeout=60)


def _raw_receiver(port: int, rank: int, world: int, sizes: list[int], rounds: int,
                  dtype: str) -> None:  # fmt: skip
    """A plain gloo rank that receives `rounds` x the buckets (element counts of `dtype`)."""
    import torch

    from slipstream.engine.weight_transport import WeightGroup

    group = WeightGroup("raw", "gloo", "127.0.0.1", port, rank, world, timeout_s=600)
    bufs = [torch.empty(n, dtype=getattr(torch, dtype)) for n in sizes]
    for _ in range(rounds):
        for b in bufs:
            group.broadcast(b)
    group.close()


def _raw_broadcast(n: int, sizes: list[int], repeats: int, dtype: str) -> list[float]:
    """Seconds per round of broadcasting the buckets to n plain receiver processes."""
    import multiprocessing as mp

    import torch

    from slipstream.engine.weight_transport import WeightGroup, free_port

    port = free_port()
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_raw_receiver, args=(port, r + 1, n + 1, sizes, repeats + 1, dtype))
             for r in range(n)]  # fmt: skip
    for p in procs:
        p.start()
    group = WeightGroup("raw", "gloo", "127.0.0.1", port, 0, n + 1, timeout_s=600)
    bufs = [torch.randn(s).to(getattr(torch, dtype)) for s in sizes]
    times = []
    for i in range(repeats + 1):
        t0 = time.perf_counter()
        for b in bufs:
            group.broadcast(b)
        if i:  # the first round warms the connections up
            times.append(time.perf_counter() - t0)
    for p in procs:
        p.join(timeout=600)
    group.close()
    return times


def run(args: argparse.Namespace) -> int:
    import httpx

    from slipstream.config import load_config
    from slipstream.engine.weight_transport import DistributedSender, TensorMeta, plan_buckets
    from slipstream.model import save_pretrained
    from slipstream.model.checkpoint import hf_from_internal
    from slipstream.observe.provenance import collect_provenance, write_result
    from slipstream.storage import WeightStore

    logging.basicConfig(level=logging.WARNING)
    cfg = load_config(args.config, args.overrides)
    counts = [int(s) for s in args.engines.split(",")]
    state, hf_config, model = _model(cfg, args.shape)
    total = sum(t.numel() * t.element_size() for t in state.values())
    metas = [TensorMeta(k, t.dtype, tuple(t.shape)) for k, t in state.items()]
    buckets = plan_buckets(metas, cfg.engine.weight_bucket_bytes)
    sizes = [sum(m.nbytes for m in b) // b[0].dtype.itemsize for b in buckets]
    load_before = os.getloadavg()
    print(f"bench weights: shape {args.shape} in {cfg.run.dtype}, {total / 1e9:.3f} GB ({len(state)} tensors, "
          f"{len(buckets)} buckets of <= {cfg.engine.weight_bucket_bytes / 2**20:.0f} MiB), "
          f"engines {counts}, {args.repeats} versions each", flush=True)  # fmt: skip
    rows: list[dict[str, Any]] = []
    version = 0
    with tempfile.TemporaryDirectory(prefix="bench-weights-") as tmp_s:
        tmp = Path(tmp_s)
        save_pretrained(model, tmp / "init")
        # what the RL job pushes (rl/weight_sync.py): the model's own stacked expert tensors,
        # whose per-expert views `state` is (refreshed in place per version, so both move)
        stacked = hf_from_internal(dict(model.state_dict()), model.config, fused_experts=True)
        del model
        for n in counts:
            raw = _raw_broadcast(n, sizes, args.repeats, cfg.run.dtype)
            procs, urls = _start_engines(n, tmp / "init", tmp, cfg.run.dtype)
            store = WeightStore(str(tmp / f"store{n}"), keep_last=1)
            sender = DistributedSender(urls, bucket_bytes=cfg.engine.weight_bucket_bytes,
                                       bucket_format=cfg.engine.weight_bucket_format,
                                       timeout_s=600, api=cfg.engine.api)  # fmt: skip
            pool = ThreadPoolExecutor(n)
            try:
                store_s, dist_s = [], []
                for _ in range(args.repeats):
                    version += 1
                    _fresh(state, version)
                    t0 = time.perf_counter()
                    store.publish(version, state, hf_config)
                    body = {"model_path": store.location(version), "weight_version": str(version)}
                    answers = list(pool.map(lambda u, b=body: httpx.post(
                        f"{u}/update_weights_from_disk", json=b, timeout=1200), urls))  # fmt: skip
                    store_s.append(time.perf_counter() - t0)
                    bad = [a.text[:300] for a in answers if a.status_code != 200]
                    if bad:
                        raise RuntimeError(f"update_weights_from_disk failed: {bad}")
                    version += 1
                    _fresh(state, version)
                    if version == 2:  # open the group (rendezvous) outside the timing
                        sender.open_group()
                    t0 = time.perf_counter()
                    report = sender.send(version, stacked)
                    dist_s.append(time.perf_counter() - t0)
                    if sorted(report.served_s) != sorted(urls):
                        raise RuntimeError(f"distributed push reached {sorted(report.served_s)}")
            finally:
                sender.close()
                pool.shutdown()
                _stop(procs)
            row = {"engines": n, "bytes": total, "store_s": statistics.median(store_s),
                   "distributed_s": statistics.median(dist_s), "raw_broadcast_s": statistics.median(raw),
                   "store_runs_s": store_s, "distributed_runs_s": dist_s, "raw_runs_s": raw}  # fmt: skip
            rows.append(row)
            print(f"  {n} engine(s): store {row['store_s']:.3f} s | distributed "
                  f"{row['distributed_s']:.3f} s | raw broadcast {row['raw_broadcast_s']:.3f} s",
                  flush=True)  # fmt: skip
    header = (f"{'engines':>7} | {'bytes':>12} | {'store s':>8} {'GB/s':>6} | {'distrib s':>9} "
              f"{'GB/s':>6} | {'raw bc s':>8} {'GB/s':>6} | {'store/dist':>10} | {'dist/raw':>8}")  # fmt: skip
    print(header)
    print("-" * len(header))
    for r in rows:
        b = r["bytes"] / 1e9
        print(f"{r['engines']:>7} | {r['bytes']:>12,} | {r['store_s']:>8.3f} {b / r['store_s']:>6.2f} | "
              f"{r['distributed_s']:>9.3f} {b / r['distributed_s']:>6.2f} | "
              f"{r['raw_broadcast_s']:>8.3f} {b / r['raw_broadcast_s']:>6.2f} | "
              f"{r['store_s'] / r['distributed_s']:>9.2f}x | {r['distributed_s'] / r['raw_broadcast_s']:>7.2f}x")  # fmt: skip
    key = next((r for r in rows if r["engines"] == 2), rows[-1])
    record = {
        "benchmark": "weights",
        "figure": {"name": f"distributed publish -> served, {key['engines']} engines, {args.shape}",
                   "value": key["distributed_s"], "unit": "s"},
        "baseline": {"name": "store publish -> served (same engines, same run)",
                     "value": key["store_s"], "unit": "s"},
        "limit": {"name": "raw gloo broadcast of the same buckets (same run)",
                  "value": key["raw_broadcast_s"], "unit": "s"},
        "goal": "distributed >= 2x faster than store, within 1.5x of raw broadcast (mid, 2 engines)",
        "api": cfg.engine.api, "shape": args.shape, "dtype": cfg.run.dtype, "bucket_bytes": cfg.engine.weight_bucket_bytes,
        "rows": rows,
        "load_avg_before": load_before, "load_avg_after": os.getloadavg(),
        "provenance": collect_provenance(),
    }  # fmt: skip
    out = write_result(args.out, record)
    print(f"\nfigure {key['distributed_s']:.3f} s (distributed, {key['engines']} engines) | baseline "
          f"{key['store_s']:.3f} s (store): {key['store_s'] / key['distributed_s']:.2f}x | limit "
          f"{key['raw_broadcast_s']:.3f} s (raw broadcast): {key['distributed_s'] / key['raw_broadcast_s']:.2f}x "
          f"of it | load avg {load_before[0]:.2f} -> {os.getloadavg()[0]:.2f}\nwrote {out}")  # fmt: skip
    return 0
