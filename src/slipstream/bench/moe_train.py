"""`slipstream bench moe-train`: the trainer's memory and step time per parallel layout.

On 4 gloo processes of this machine (2 simulated nodes x 2 ranks) the real Trainer
(`build_trainer`, slipstream.parallel) trains the same synthetic GRPO batches with a model whose
experts dominate its parameters (default 32 experts top-4, hidden 64, 2 MoE layers), for each
layout:
- replicated  (trainer.parallel.dp_replicate 4): every rank holds everything (the baseline),
- fsdp        (dp_shard 4): FSDP2 shards every parameter, no expert parallelism,
- fsdp+ep     (ep 4 over 2 nodes): experts split over the 4 ranks, dense parameters FSDP2-sharded,
              once per dispatcher (exact, padded, hierarchical).
Figures, per layout:
- bytes per rank (max over ranks) of parameters, gradients and optimizer state, measured from the
  tensors each rank holds, split into experts and the rest; limit: the replicated total / 4;
- the expert part's fraction of that limit (the goal: within 10%),
- median step time (max over ranks per step; gloo on a shared 2-core CPU: noise-dominated and
  not indicative of NVLink/EFA),
- inter-node bytes per step of the EP all-to-alls (byte meter, forward; backward sends the same
  bytes again), hierarchical vs exact, against the cost model's ratio for uniform routing (the
  trained router is not uniform, so the cost model is a reference, not a bound);
- a step-time limit: the whole batch's GEMMs and one AdamW step at this machine's measured
  1-thread speed (`bench limits`, bench/limits.py), spread perfectly over min(world, cores)
  cores; each layout's median step time is printed as a fraction of it.
JSON with provenance goes to benchmarks/results/moe_train.json (or --out).

Not covered: a real inter-node link (no emulated bandwidth cap), GPUs.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from slipstream.config.args import add_config_args

LAYOUTS: dict[str, list[str]] = {
    "replicated": ["trainer.parallel.dp_replicate=4"],
    "fsdp": ["trainer.parallel.dp_shard=4"],
    "fsdp+ep exact": ["trainer.parallel.ep=4", "trainer.ep_dispatcher=exact"],
    "fsdp+ep padded": ["trainer.parallel.ep=4", "trainer.ep_dispatcher=padded"],
    "fsdp+ep hierarchical": ["trainer.parallel.ep=4", "trainer.ep_dispatcher=hierarchical"],
}
WORLD, RANKS_PER_NODE = 4, 2


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "moe-train",
        help="MoE trainer: per-rank memory and step time, replicated vs FSDP vs FSDP+EP",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_config_args(p, quickstart_default=False)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--steps", type=int, default=5, help="timed steps per layout (median)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--groups", type=int, default=8, help="groups per step")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--out", default="benchmarks/results/moe_train.json", help="JSON output")
    p.set_defaults(func=run)


def _model_overrides(args: argparse.Namespace) -> list[str]:
    return [
        "model.vocab_size=40", f"model.hidden_size={args.hidden}",
        f"model.num_hidden_layers={args.layers}", "model.num_attention_heads=4",
        "model.num_key_value_heads=2", "model.head_dim=16",
        f"model.moe_intermediate_size={args.hidden}", f"model.num_experts={args.experts}",
        f"model.num_experts_per_tok={args.top_k}", "model.max_position_embeddings=64",
        "model.router_aux_loss_coef=0.01",
    ]  # fmt: skip


def _rank(init_dir: str, overrides: list[str], steps: int, warmup: int, groups: int,
          group_size: int) -> dict[str, Any]:  # fmt: skip
    """Runs in every rank: train warmup + steps batches; memory, times and EP bytes."""
    import torch
    import torch.distributed as dist

    from slipstream.config import load_config
    from slipstream.moe.layer import ExpertParallelExperts
    from slipstream.parallel.sharding import sharded_param_bytes
    from slipstream.rl.trainer import build_trainer

    cfg = load_config(None, overrides)
    trainer = build_trainer(cfg, init_dir, torch.device("cpu"), pad_id=0)
    batches = _batches(warmup + steps, groups, group_size, cfg.model.vocab_size)
    meters = [m.dispatcher.meter for m in trainer.model.modules()
              if isinstance(m, ExpertParallelExperts)]  # fmt: skip
    times_s = []
    for i, batch in enumerate(batches):
        if i == warmup:
            for meter in meters:
                meter.reset()
        dist.barrier()
        t0 = time.perf_counter()
        trainer.step(batch)
        times_s.append(time.perf_counter() - t0)
    inter = intra = 0
    for meter in meters:
        for phase in ("dispatch", "combine"):
            inter += meter.total(phase, "inter")
            intra += meter.total(phase, "intra")
    return {"bytes": sharded_param_bytes(trainer.model, trainer.optimizer),
            "step_s": times_s[warmup:], "inter_bytes_fwd": inter / steps,
            "intra_bytes_fwd": intra / steps}  # fmt: skip


def _batches(num: int, num_groups: int, group_size: int, vocab: int) -> list[Any]:
    import random

    from slipstream.rl.types import Batch, Group, Sample, TaskRef

    rng = random.Random(0)
    out = []
    for step in range(num):
        groups = []
        for g in range(num_groups):
            prompt = [1] + [rng.randrange(3, vocab) for _ in range(rng.randrange(6, 14))]
            samples = []
            for i in range(group_size):
                n = rng.randrange(4, 16)
                samples.append(Sample(prompt, [rng.randrange(3, vocab) for _ in range(n)],
                                      [-1.0] * n, [step] * n, reward=float((g + i) % 2)))  # fmt: skip
            groups.append(Group(TaskRef(step * num_groups + g, g), samples))
        out.append(Batch(groups, trainer_version=step, staleness=[0] * num_groups))
    return out


def _step_limit(model_cfg: Any, args: argparse.Namespace) -> dict[str, Any]:
    """The whole batch's GEMMs + one AdamW step at 1-thread speed, over min(world, cores)."""
    import os

    from slipstream.bench.limits import measure_limits

    (batch,) = _batches(1, args.groups, args.group_size, model_cfg.vocab_size)
    tokens = sum(len(s.prompt_ids) + len(s.completion_ids) - 1 for s in batch.samples)
    lim = measure_limits(model_cfg, num_tokens=tokens, seq_len=tokens / len(batch.samples),
                         parts=("train",), num_threads=1)  # fmt: skip
    cores = min(WORLD, os.cpu_count() or 1)
    return {"tokens": tokens, "cores": cores, "step_s": lim.train.step_s / cores,
            "clock": lim.clock, "limits": lim.to_dict()}  # fmt: skip


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f}"


def run(args: argparse.Namespace) -> int:
    import torch

    from slipstream.config import load_config
    from slipstream.model import MoEForCausalLM, save_pretrained
    from slipstream.moe.cost_model import predicted_inter_node_ratio
    from slipstream.observe.provenance import collect_provenance, write_result
    from slipstream.runtime import spawn_ranks

    model_o = _model_overrides(args)
    train_o = [f"trainer.num_processes={WORLD}", f"trainer.groups_per_step={args.groups}",
               f"rollout.group_size={args.group_size}", "trainer.skip_no_signal=false",
               f"trainer.parallel.ranks_per_node={RANKS_PER_NODE}", "run.num_threads=1",
               *args.overrides]  # fmt: skip
    cfg = load_config(None, model_o)
    print(f"bench moe-train: {WORLD} gloo ranks = {WORLD // RANKS_PER_NODE} simulated nodes x "
          f"{RANKS_PER_NODE}; {args.experts} experts top-{args.top_k}, hidden {args.hidden}, "
          f"{args.layers} layers; {args.groups} x {args.group_size} samples per step")  # fmt: skip
    results: dict[str, Any] = {}
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-moe-train-") as tmp:
        init = Path(tmp) / "init"
        torch.manual_seed(0)
        model = MoEForCausalLM(cfg.model)
        save_pretrained(model, init)
        total_expert = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                           if ".mlp.experts." in n)  # fmt: skip
        total_dense = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                          if ".mlp.experts." not in n)  # fmt: skip
        for name, layout in LAYOUTS.items():
            t0 = time.perf_counter()
            ranks = spawn_ranks("slipstream.bench.moe_train:_rank", WORLD,
                                {"init_dir": str(init), "overrides": [*model_o, *train_o, *layout],
                                 "steps": args.steps, "warmup": args.warmup, "groups": args.groups,
                                 "group_size": args.group_size}, timeout_s=600)  # fmt: skip
            step_s = [max(r["step_s"][i] for r in ranks) for i in range(args.steps)]
            mem = {k: max(r["bytes"][k] for r in ranks) for k in ranks[0]["bytes"]}
            results[name] = {
                "overrides": layout, "bytes_per_rank_max": mem,
                "step_s_median": statistics.median(step_s), "step_s": step_s,
                "inter_bytes_per_step_fwd": sum(r["inter_bytes_fwd"] for r in ranks),
                "intra_bytes_per_step_fwd": sum(r["intra_bytes_fwd"] for r in ranks),
                "wall_s": time.perf_counter() - t0,
            }  # fmt: skip
            print(f"  {name}: {time.perf_counter() - t0:.0f} s", flush=True)
    # params + grads + AdamW's two moments: 4 copies of every parameter's bytes
    limit_expert = 4 * total_expert / WORLD
    limit_dense = 4 * total_dense / WORLD
    header = (f"{'layout':<22} {'experts MiB':>11} {'of limit':>8} {'dense MiB':>9} "
              f"{'step ms':>8} {'inter MiB/step':>14}")  # fmt: skip
    print(header)
    print("-" * len(header))
    for name, r in results.items():
        m = r["bytes_per_rank_max"]
        expert = m["expert_param"] + m["expert_grad"] + m["expert_optim"]
        dense = m["dense_param"] + m["dense_grad"] + m["dense_optim"]
        r["expert_fraction_of_limit"] = expert / limit_expert
        inter = 2 * r["inter_bytes_per_step_fwd"]  # backward repeats the forward's sends
        print(f"{name:<22} {_mib(expert):>11} {expert / limit_expert:>7.2f}x {_mib(dense):>9} "
              f"{1e3 * r['step_s_median']:>8.1f} {_mib(inter) if inter else '-':>14}")  # fmt: skip
    exact = results["fsdp+ep exact"]["inter_bytes_per_step_fwd"]
    hier = results["fsdp+ep hierarchical"]["inter_bytes_per_step_fwd"]
    model_ratio = predicted_inter_node_ratio(args.experts, WORLD // RANKS_PER_NODE, args.top_k)
    print(f"limit (replicated total / {WORLD}): experts {_mib(limit_expert)} MiB, dense "
          f"{_mib(limit_dense)} MiB per rank (params + grads + AdamW moments)")  # fmt: skip
    print(f"inter-node bytes per step, hierarchical / exact: {hier / exact:.3f} (cost model, "
          f"uniform routing, payload only: {model_ratio:.3f})")  # fmt: skip
    print("(step times: gloo over loopback on a shared 2-core CPU; the bytes are the figure; "
          f"wall {time.perf_counter() - t_start:.0f} s)")  # fmt: skip
    step_limit = _step_limit(cfg.model, args)
    print(f"step-time limit {1e3 * step_limit['step_s']:.1f} ms ({step_limit['tokens']} tokens, "
          f"{step_limit['cores']} cores, {step_limit['clock']}): " + ", ".join(
              f"{n} {step_limit['step_s'] / r['step_s_median']:.1%}" for n, r in results.items()))  # fmt: skip
    fsdp_ep = results["fsdp+ep exact"]["expert_fraction_of_limit"]
    record = {
        "benchmark": "moe_train",
        "figure": {"name": "FSDP+EP expert bytes per rank / (total / world)", "value": fsdp_ep},
        "baseline": {"name": "replicated expert bytes per rank / (total / world)",
                     "value": results["replicated"]["expert_fraction_of_limit"]},
        "limit": {"name": "total / world", "value": 1.0},
        "meets_goal": abs(fsdp_ep - 1.0) <= 0.10,
        "layouts": results,
        "totals_bytes": {"expert_params": total_expert, "dense_params": total_dense},
        "inter_ratio_hierarchical_vs_exact": hier / exact,
        "cost_model_inter_ratio_uniform": model_ratio,
        "step_time_limit": step_limit,
        "setting": {"world": WORLD, "ranks_per_node": RANKS_PER_NODE, "experts": args.experts,
                    "top_k": args.top_k, "hidden": args.hidden, "layers": args.layers,
                    "groups": args.groups, "group_size": args.group_size, "steps": args.steps},
        "provenance": collect_provenance(),
    }  # fmt: skip
    out = write_result(args.out, record)
    print(f"figure: FSDP+EP experts {fsdp_ep:.2f}x of total/world (goal within 10%: "
          f"{'met' if record['meets_goal'] else 'NOT met'}) | baseline replicated "
          f"{record['baseline']['value']:.2f}x\nwrote {out}")  # fmt: skip
    return 0
