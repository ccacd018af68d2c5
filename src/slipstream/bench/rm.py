"""`slipstream bench rm`: reward-model scoring throughput, the way rollout workers score.

Scores --num texts (train prompts + their demonstrations, the sequences an RL job scores) three
ways, in one run, on the same model:
- figure: through a real `slipstream serve --model RM_DIR` process (POST /classify), from
  --concurrency client threads each calling `BatchingScorer.score_one` (rm/source.py: what a
  worker's verify threads do; concurrent texts coalesce into calls of <= --max-batch),
- baseline: in-process, one text per forward (no batching),
- limit: in-process, all texts in forwards of --max-batch (the model alone, no HTTP, no waiting
  for company).
Sequences per second each; JSON with provenance (CPU model, load average) in
benchmarks/results/rm.json (or --out). The model: --model RM_DIR, else a random reward model of
the config's [model] shape. Not covered: GPU, several server replicas, long sequences.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from slipstream.config.args import add_config_args


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("rm", help="reward-model scoring throughput: served + batched vs limits",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    add_config_args(p)
    p.add_argument("--model", default=None, metavar="DIR", help="reward model (default: random)")
    p.add_argument("--num", type=int, default=512, help="texts scored per way")
    p.add_argument("--concurrency", type=int, default=32, help="client threads (served way)")
    p.add_argument("--max-batch", type=int, default=64, help="texts per scoring call")
    p.add_argument("--out", default="benchmarks/results/rm.json", help="JSON output path")
    p.set_defaults(func=run)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _served_rate(model_dir: Path, texts: list[str], args: argparse.Namespace) -> dict[str, Any]:
    import httpx

    from slipstream.rm.source import BatchingScorer, HTTPScorer

    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-c", "from slipstream.cli import main; raise SystemExit(main())",
         "serve", "--model", str(model_dir), "--port", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"slipstream serve exited with {proc.returncode}")
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("slipstream serve: no /health within 120 s")
            time.sleep(0.1)
        scorer = BatchingScorer(HTTPScorer(url, 60.0), args.max_batch, 0.005, 60.0)
        scorer.score_one(texts[0])  # warm-up (connection, first forward)
        scorer.calls = scorer.texts = 0
        todo = list(texts)
        lock = threading.Lock()

        def client() -> None:
            while True:
                with lock:
                    if not todo:
                        return
                    text = todo.pop()
                scorer.score_one(text)

        t0 = time.perf_counter()
        threads = [threading.Thread(target=client) for _ in range(args.concurrency)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        scorer.close()
        return {"seq_per_s": len(texts) / wall, "calls": scorer.calls,
                "mean_batch": scorer.texts / max(1, scorer.calls)}  # fmt: skip
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def run(args: argparse.Namespace) -> int:
    import torch

    from slipstream.config import load_config
    from slipstream.observe.provenance import collect_provenance, write_result
    from slipstream.rm.model import MoERewardModel, load_reward_model, save_reward_model, score_ids
    from slipstream.tasks import get_taskset

    cfg = load_config(args.config, args.overrides)
    taskset = get_taskset(cfg.task)
    tok = taskset.tokenizer
    texts = [t.prompt + taskset.demonstration(t) for t in taskset.train_batch(0, args.num)]
    with tempfile.TemporaryDirectory(prefix="bench-rm-") as tmp:
        if args.model:
            model_dir = Path(args.model)
        else:
            torch.manual_seed(0)
            model_cfg = cfg.model.model_copy(update={"vocab_size": tok.vocab_size})
            model_dir = save_reward_model(MoERewardModel(model_cfg).eval(), Path(tmp) / "rm", tok)
        # torch's default thread count here, as in the server process (which sets none)
        rm = load_reward_model(model_dir)
        seqs = [tok.encode_prompt(t) for t in texts]
        score_ids(rm, seqs[:8], tok.pad_id)  # warm-up
        t0 = time.perf_counter()
        score_ids(rm, seqs, tok.pad_id, args.max_batch)
        limit = len(seqs) / (time.perf_counter() - t0)
        few = seqs[: min(len(seqs), 128)]
        t0 = time.perf_counter()
        for s in few:
            score_ids(rm, [s], tok.pad_id)
        baseline = len(few) / (time.perf_counter() - t0)
        served = _served_rate(model_dir, texts, args)
    load = os.getloadavg()
    record = {
        "benchmark": "rm",
        "figure": {"name": f"served /classify, {args.concurrency} client threads, batched",
                   "value": served["seq_per_s"], "unit": "sequences/s"},
        "baseline": {"name": "in-process, one sequence per forward", "value": baseline},
        "limit": {"name": f"in-process forwards of {args.max_batch}", "value": limit},
        "served": served, "num": len(texts), "max_batch": args.max_batch,
        "mean_tokens": sum(map(len, seqs)) / len(seqs),
        "model": str(args.model or "random [model]"),
        "params": rm.num_parameters(),
        "torch_threads": torch.get_num_threads(),
        "provenance": collect_provenance({"loadavg_1_5_15": load}),
    }  # fmt: skip
    out = write_result(args.out, record)
    print(f"figure {served['seq_per_s']:.0f} seq/s served (mean batch {served['mean_batch']:.1f}, "
          f"{served['calls']} calls) | baseline {baseline:.0f} seq/s unbatched | limit "
          f"{limit:.0f} seq/s in-process batched | {len(texts)} texts x "
          f"{record['mean_tokens']:.1f} tokens, {record['params'] / 1e6:.2f}M params; "
          f"CPU {record['provenance']['cpu_model']}, load {load[0]:.1f}\nwrote {out}")  # fmt: skip
    return 0
