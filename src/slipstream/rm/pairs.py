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
from slipstream.config.base import ConfigError


@dataclass(frozen=True)
class Pair:
    prompt: str
    chosen: str
    rejected: str


class PairsError(ConfigError):
    """A preference-pairs file (rm.pairs) that cannot be used: one line naming the file and the
    line (the CLI prints it as a config error, rc 2)."""


def read_pairs(path: str | Path) -> list[Pair]:
    """Every pair of a JSON-lines file; PairsError naming the file and line for a line that is
    not one (not UTF-8, not JSON, nested too deeply, a key missing, a value not a string) or a
    file without pairs."""
    out: list[Pair] = []
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            where = f"{path}:{n}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise PairsError(
                    f"{where}: not UTF-8 text ({e.reason} at byte {e.start})"
                ) from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise PairsError(f"{where}: not JSON ({e.msg}, column {e.colno})") from None
            except RecursionError:
                raise PairsError(f"{where}: JSON nested too deeply") from None
            if not isinstance(row, dict):
                raise PairsError(f"{where}: not a preference pair: a JSON object "
                                 f"{{prompt, chosen, rejected}}, got {type(row).__name__}")  # fmt: skip
            missing = [k for k in ("prompt", "chosen", "rejected") if k not in row]
            if missing:
                raise PairsError(f"{where}: not a preference pair: no {', '.join(missing)}")
            bad = {
                k: row[k] for k in ("prompt", "chosen", "rejected") if not isinstance(row[k], str)
            }
            if bad:
                shown = ", ".join(
                    f"{k} = {str(v)[:40]!s} ({type(v).__name__})" for k, v in bad.items()
                )
                raise PairsError(f"{where}: prompt, chosen and rejected must be strings: {shown}")
            out.append(Pair(row["prompt"], row["chosen"], row["rejected"]))
    if not out:
        raise PairsError(f"{path}: no preference pairs (an empty file)")
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
