"""Measure what streaming a data file larger than memory costs a process: write a JSONL file of
SIZE_GIB (rows of ~1 KB: prompt, answer, a padding column), index it as `task.name = "dataset"`
does (one streaming pass), then draw TRAIN_DRAWS training tasks spread over the whole epoch, and
print the process's peak RSS (ru_maxrss) next to the RSS before the data was touched and the file
size. Used for the figure in docs/data.md.

    python examples/stream_rss.py [SIZE_GIB=2] [TRAIN_DRAWS=20000] [DIR=/tmp]
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def main() -> None:
    size_gib = float(sys.argv[1]) if len(sys.argv) > 1 else 2.0
    draws = int(sys.argv[2]) if len(sys.argv) > 2 else 20_000
    path = os.path.join(sys.argv[3] if len(sys.argv) > 3 else "/tmp", f"stream-{size_gib:g}g.jsonl")
    pad = "x" * 1000
    if not os.path.exists(path) or os.path.getsize(path) < size_gib * 2**30:
        with open(path, "w") as f:
            i = 0
            while f.tell() < size_gib * 2**30:
                f.write(json.dumps({"prompt": f"{i % 1000}+{i // 1000 % 1000}=", "answer": str(i),
                                    "pad": pad}) + "\n")  # fmt: skip
                i += 1
    from slipstream.config import load_config
    from slipstream.tasks import get_taskset

    cfg = load_config(None, ["task.name=dataset", f"task.train_files=['{path}']",
                             "task.num_heldout=10"])  # fmt: skip
    import slipstream.model.tokenizer  # noqa: F401  (torch and the tokenizer loaded before the baseline)

    base = rss_mib()
    t0 = time.monotonic()
    ts = get_taskset(cfg.task)
    index_s = time.monotonic() - t0
    after_index = rss_mib()
    n = ts.sources[0].count_train
    t0 = time.monotonic()
    step = max(1, n // draws)
    for i in range(0, n, step):
        ts.train(i)
    draw_s = time.monotonic() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({
        "file_mib": round(os.path.getsize(path) / 2**20), "rows": ts.stats()[0].rows,
        "train_rows": n, "shuffle_buffer": cfg.task.shuffle_buffer,
        "rss_before_mib": round(base), "rss_after_index_mib": round(after_index),
        "rss_after_draws_mib": round(rss_mib()), "peak_rss_mib": round(peak),
        "index_s": round(index_s, 1), "draws": len(range(0, n, step)), "draw_s": round(draw_s, 1),
    }))  # fmt: skip


if __name__ == "__main__":
    main()
