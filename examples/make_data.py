"""Write the example dataset of docs/data.md: addition problems in TRL's, verl's and OpenRLHF's
layouts, each as JSONL and as Parquet (nothing downloaded; deterministic for a seed).

    python examples/make_data.py [OUT_DIR]        # default examples/data/

Files (one row per problem, the same problems in every layout):
- trl.jsonl / trl.parquet: `prompt` (a string), `answer`, `difficulty` (an extra column)
- verl.jsonl / verl.parquet: `prompt` (chat messages), `data_source`, `ability`,
  `reward_model` = {style, ground_truth}, `extra_info` = {split, index}
- openrlhf.jsonl / openrlhf.parquet: `input`, `label`
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import Any


def problems(n: int = 600, seed: int = 0) -> list[tuple[str, str, int]]:
    """(prompt, answer, difficulty): a+b with one- and two-digit operands, distinct prompts."""
    rng = random.Random(seed)
    seen: set[str] = set()
    out = []
    while len(out) < n:
        a, b = rng.randrange(100), rng.randrange(100)
        prompt = f"{a}+{b}="
        if prompt not in seen:
            seen.add(prompt)
            out.append((prompt, str(a + b), len(str(a)) + len(str(b))))
    return out


def layouts(n: int = 600, seed: int = 0) -> dict[str, list[dict[str, Any]]]:
    rows = problems(n, seed)
    return {
        "trl": [{"prompt": p, "answer": a, "difficulty": d} for p, a, d in rows],
        "verl": [
            {
                "data_source": "example/addition",
                "prompt": [{"role": "user", "content": p}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": a},
                "extra_info": {"split": "train", "index": i},
            }
            for i, (p, a, _) in enumerate(rows)
        ],
        "openrlhf": [{"input": p, "label": a} for p, a, _ in rows],
    }


def write(out_dir: str | Path, n: int = 600, seed: int = 0) -> list[Path]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, rows in layouts(n, seed).items():
        jsonl = out_dir / f"{name}.jsonl"
        jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
        parquet = out_dir / f"{name}.parquet"
        pq.write_table(pa.Table.from_pylist(rows), parquet, row_group_size=256)
        written += [jsonl, parquet]
    return written


if __name__ == "__main__":
    target = sys.argv[1] if len(sys.argv) > 1 else Path(__file__).with_name("data")
    for path in write(target):
        print(path)
