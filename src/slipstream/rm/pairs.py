"""Preference pairs: the JSON-lines file `slipstream rm train` reads, and pairs made from a
built-in task (the verifier's verdicts on completions the SFT checkpoint samples, with a stated
share of flipped labels), for the RLHF demonstration (docs/rlhf.md).

    pairs = read_pairs("pairs.jsonl")                      # [Pair(prompt, chosen, rejected)]
    stats = make_task_pairs(cfg, "sft/checkpoint", out)    # writes out, returns counts

A line is {"prompt": str, "chosen": str, "rejected": str}; other keys are kept out of training
(the task pairs record "flipped": whether the noise swapped them, for the report only).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slipstream.config import SlipstreamConfig


@dataclass(frozen=True)
class Pair:
    prompt: str
    chosen: str
    rejected: str


def read_pairs(path: str | Path) -> list[Pair]:
    """Every pair of a JSON-lines file; a line that is not one names the file and line."""
    out: list[Pair] = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                pair = Pair(row["prompt"], row["chosen"], row["rejected"])
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{n}: not a preference pair "
                                 f"{{prompt, chosen, rejected}}: {e}") from None  # fmt: skip
            if not all(isinstance(x, str) for x in (pair.prompt, pair.chosen, pair.rejected)):
                raise ValueError(f"{path}:{n}: prompt, chosen and rejected must be strings")
            out.append(pair)
    if not out:
        raise ValueError(f"{path}: no preference pairs")
    return out


def make_task_pairs(
    cfg: SlipstreamConfig, checkpoint: str | Path, out: str | Path
) -> dict[str, Any]:
    """Sample rm.pair_samples completions for each of the first rm.pair_prompts train tasks from
    `checkpoint` (rm.pair_temperature, eval.max_new_tokens), verify them, and write one pair per
    (passing, failing) completion of a prompt: chosen = a passing one (cycled), rejected = the
    failing one; a seeded coin (run.seed) swaps rm.label_noise of them. Returns counts."""
    from slipstream.evaluate import decode, load_for_eval

    model, taskset, _ = load_for_eval(checkpoint, cfg)
    tasks = taskset.train_batch(0, cfg.rm.pair_prompts)
    tok = taskset.tokenizer
    outs = decode(model, [taskset.prompt_ids(t) for t in tasks], cfg.eval.max_new_tokens,
                  tok.eos_id, temperature=cfg.rm.pair_temperature, num_samples=cfg.rm.pair_samples,
                  seed=cfg.run.seed, max_batch_size=cfg.eval.batch_size)  # fmt: skip
    rng = random.Random(f"rm-pairs/{cfg.run.seed}")
    rows: list[dict[str, Any]] = []
    passed = 0
    k = cfg.rm.pair_samples
    for i, task in enumerate(tasks):
        texts = [tok.decode(ids) for ids in outs[i * k : (i + 1) * k]]
        good = [t for t in texts if taskset.verify(task, t).reward >= 0.5]
        bad = [t for t in texts if taskset.verify(task, t).reward < 0.5]
        passed += len(good)
        for j, rejected in enumerate(bad if good else []):
            chosen = good[j % len(good)]
            flipped = rng.random() < cfg.rm.label_noise
            if flipped:
                chosen, rejected = rejected, chosen
            rows.append({"prompt": task.prompt, "chosen": chosen, "rejected": rejected,
                         "flipped": flipped})  # fmt: skip
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tmp.replace(out)
    return {
        "prompts": len(tasks),
        "samples": len(tasks) * k,
        "sample_pass_rate": passed / (len(tasks) * k),
        "pairs": len(rows),
        "flipped": sum(r["flipped"] for r in rows),
        "label_noise": cfg.rm.label_noise,
    }
