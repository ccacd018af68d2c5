"""`slipstream bench engine --prefix-cache`: the native engine's prefix cache across requests
(engine/prefix_cache.py) on the two RL workloads it is for, each run with and without it on the
same weights, prompts and seeds:

- GRPO groups as separate requests: P prompts, each sent G times with n = 1 (a client that does
  not use n), all submitted at once;
- multi-turn episodes: E episodes of T turns; turn k's prompt is turn k-1's prompt + its
  completion + 8 new "user" tokens (what an agent resends), every episode's turn k concurrent.

Figure: prefill tokens per output token with the cache; baseline: the same without it; limit
(goal): <= half the baseline on the multi-turn workload. Also: prefix-cache hit rate (prompt
tokens served from cache / prompt tokens looked up), wall time, outputs equal (greedy).
Uses `bench engine`'s quickstart-shaped model (--models' first entry), temperature 0.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any


def _workloads(args: argparse.Namespace) -> tuple[list[list[int]], int, int, int]:
    import torch

    g = torch.Generator().manual_seed(args.seed + 1)
    lens = torch.randint(8, 25, (args.episodes,), generator=g).tolist()
    prompts = [torch.randint(3, args.vocab, (n,), generator=g).tolist() for n in lens]
    return prompts, args.turns, 8, args.max_new_tokens


def _engine(model: Any, args: argparse.Namespace, slot_len: int, prefix_tokens: int) -> Any:
    from slipstream.config.engine import EngineConfig
    from slipstream.engine import build_engine

    cfg = EngineConfig(max_batch_size=args.max_batch_size,
                       kv_cache_tokens=args.max_batch_size * slot_len, max_seq_len=slot_len,
                       device=args.device, prefix_cache_tokens=prefix_tokens)  # fmt: skip
    return build_engine(cfg, model, eos_token_ids=[])


def _grpo(model: Any, args: argparse.Namespace, prompts: list[list[int]], slot_len: int,
          prefix_tokens: int) -> dict[str, Any]:  # fmt: skip
    from slipstream.engine import GenerateRequest, SamplingParams

    sp = SamplingParams(temperature=0, max_new_tokens=args.max_new_tokens)
    with _engine(model, args, slot_len, prefix_tokens) as eng:
        reqs = [GenerateRequest(p, sp) for p in prompts for _ in range(args.group)]
        t0 = time.perf_counter()
        out = eng.generate(reqs)
        wall = time.perf_counter() - t0
        return _summary(eng.stats, out, wall)


def _multi_turn(model: Any, args: argparse.Namespace, prompts: list[list[int]], slot_len: int,
                prefix_tokens: int) -> dict[str, Any]:  # fmt: skip
    import torch

    from slipstream.engine import GenerateRequest, SamplingParams

    sp = SamplingParams(temperature=0, max_new_tokens=args.max_new_tokens)
    g = torch.Generator().manual_seed(args.seed + 2)
    histories = [list(p) for p in prompts]
    outs: list[Any] = []
    with _engine(model, args, slot_len, prefix_tokens) as eng:
        t0 = time.perf_counter()
        for turn in range(args.turns):
            if turn:
                histories = [h + torch.randint(3, args.vocab, (8,), generator=g).tolist()
                             for h in histories]  # fmt: skip
            done = eng.generate([GenerateRequest(h, sp) for h in histories])
            histories = [h + c.token_ids for h, c in zip(histories, done, strict=True)]
            outs += done
        wall = time.perf_counter() - t0
        return _summary(eng.stats, outs, wall)


def _summary(stats: dict[str, float], out: list[Any], wall: float) -> dict[str, Any]:
    tokens = sum(len(c.token_ids) for c in out)
    query = stats["prefix_cache_query_tokens"]
    return {
        "output_tokens": tokens,
        "prefill_tokens": stats["prefill_tokens"],
        "prefill_per_output_token": stats["prefill_tokens"] / max(1, tokens),
        "hit_rate": stats["prefix_cache_hit_tokens"] / query if query else 0.0,
        "wall_s": wall,
        "token_ids": [c.token_ids for c in out],
    }


def run_prefix_cache(args: argparse.Namespace) -> int:
    import torch

    from slipstream.bench.models import build_bench_model
    from slipstream.observe.provenance import collect_provenance, write_result

    torch.set_num_threads(args.threads)
    load_start = os.getloadavg()
    prompts, turns, user_tokens, max_new = _workloads(args)
    slot_len = 24 + turns * (max_new + user_tokens)
    name = args.models.split(",")[0]
    model = build_bench_model(name, args.vocab, slot_len, args.device, args.seed)
    prefix_tokens = args.prefix_cache_tokens
    rows = []
    print(f"prefix cache ({prefix_tokens} tokens) on {name}: prefill tokens per output token")
    print(f"{'workload':<28} {'with cache':>10} {'without':>8} {'ratio':>6} {'goal':>6} "
          f"{'hit rate':>8} {'wall with/without s':>20} same outputs")  # fmt: skip
    for label, fn in ((f"GRPO {args.episodes} prompts x {args.group} reqs", _grpo),
                      (f"multi-turn {args.episodes} eps x {turns} turns", _multi_turn)):  # fmt: skip
        with_c = fn(model, args, prompts, slot_len, prefix_tokens)
        without = fn(model, args, prompts, slot_len, 0)
        ratio = with_c["prefill_per_output_token"] / max(1e-9, without["prefill_per_output_token"])
        goal = 0.5 if label.startswith("multi") else None
        same = with_c.pop("token_ids") == without.pop("token_ids")
        rows.append({"workload": label, "with_cache": with_c, "without_cache": without,
                     "ratio": ratio, "goal_ratio_at_most": goal, "same_outputs": same})  # fmt: skip
        print(f"{label:<28} {with_c['prefill_per_output_token']:>10.2f} "
              f"{without['prefill_per_output_token']:>8.2f} {ratio:>6.2f} "
              f"{'-' if goal is None else f'<={goal}':>6} {with_c['hit_rate']:>8.2f} "
              f"{with_c['wall_s']:>9.2f}/{without['wall_s']:<9.2f} {same}", flush=True)  # fmt: skip
    prov = collect_provenance({"loadavg_start": load_start, "loadavg_end": os.getloadavg()})
    print(f"CPU {prov['cpu_model']}, {args.threads} thread(s), load {load_start[0]:.2f} -> "
          f"{prov['loadavg_end'][0]:.2f}")  # fmt: skip
    result = {
        "benchmark": "engine_prefix_cache",
        "metric": "prefill tokens per output token (with / without the prefix cache)",
        "goals": {"multi_turn_ratio_at_most": 0.5},
        "settings": {k: v for k, v in vars(args).items() if k != "func"},
        "results": rows,
        "provenance": prov,
    }
    out = write_result(args.out.replace("engine.json", "engine_prefix_cache.json"), result)
    print(f"wrote {out}")
    return 0
