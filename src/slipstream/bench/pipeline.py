"""`slipstream bench pipeline`: sync vs async RL pipeline throughput in one run, same machine, same
start checkpoint, same config except `trainer.mode`.

Verification latency: with `--verify-latency real` only the task's own verifier runs, e.g.
`--task code --sandbox bwrap` executes every completion's test suite in a real bwrap sandbox
from each worker's pool (the sandbox-bound case); with `lognormal` a delay drawn per sample
(median --verify-p50-s, p99/p50 = --verify-p99-over-p50, default 5: the spread sandboxed test
suites show) is added before the task's verifier. `auto` (default): real when the task's answers
are verified in a sandbox (sandbox.verify_in_sandbox) or its episodes call tools in
sandboxes (task.env), lognormal otherwise.

Per mode the benchmark runs the real job (trainer in this process,
rollout worker processes, WeightStore on local disk) for --steps steps and reports:
- samples/s: trained samples / wall time of the RL loop (evaluation excluded), and the steady
  rate after the first third of the steps (async's pipeline fill excluded: it leases
  max_inflight_tasks x workers groups before its first step, which a short run never trains on);
- trainer idle fraction: time the trainer waited for a batch / wall time;
- final reward: mean batch reward of the last third of the steps, and held-out pass@1 after.

figure = async samples/s, baseline = sync samples/s, limit = the goal ratio (3x on
sandbox-bound work, 1.5x with the lognormal stand-in). Also printed:
each mode's samples/s as a fraction of the trainer's limit in samples/s (`bench limits`: this
machine's GEMM + AdamW speed for the run's positions per sample, bench/limits.py), the most a
trainer-bound pipeline could reach; and, when answers are verified in sandboxes, the sandbox
limit: the same number of private pools as rollout workers, built from the run's [sandbox]
section, verifying the task's reference solutions with nothing else running (the most samples/s
a pipeline bound by its sandboxes could reach here; generation not included). Writes JSON
with provenance (load average included) to benchmarks/results/pipeline.json (or --out).

Not covered: multi-host runs, GPU engines, equal-reward runs of different lengths (both modes run
the same number of steps; rewards are reported side by side).
"""

from __future__ import annotations

import argparse
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from slipstream.config.args import add_config_args

GOAL_RATIO = 1.5
"""async/sync goal with the lognormal stand-in verifier."""
GOAL_RATIO_SANDBOXED = 3.0
"""async/sync goal on sandbox-bound work (real sandboxed verification or tool calls)."""
SANDBOX_LIMIT_VERIFICATIONS_PER_POOL = 48
"""Verifications per pool for the sandbox limit (~5 s per pool on the 2-vCPU dev VM)."""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("pipeline", help="RL pipeline samples/s and trainer idle: sync vs async",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    add_config_args(p)
    p.add_argument("--steps", type=int, default=12, help="trainer steps per mode")
    p.add_argument("--modes", default="sync,async", help="comma list (first is the baseline)")
    p.add_argument("--max-staleness", type=int, default=2, help="async staleness bound")
    p.add_argument("--task", default=None, help="task set (sets task.name): arithmetic, "
                   "countdown, code, tool_arithmetic, ...")  # fmt: skip
    p.add_argument(
        "--sandbox",
        default=None,
        choices=["process", "bwrap", "qemu", "firecracker"],
        help="sandbox backend for sandboxed verification (sets sandbox.backend)",
    )
    p.add_argument("--verify-latency", default="auto", choices=["auto", "real", "lognormal"],
                   help="verifier latency: the task's real verifier only, or plus a lognormal "
                   "delay; auto = real for sandbox-verified tasks (default: %(default)s)")  # fmt: skip
    p.add_argument("--verify-p50-s", type=float, default=0.25, help="median verifier latency")
    p.add_argument("--verify-p99-over-p50", type=float, default=5.0, help="latency tail ratio")
    p.add_argument("--workers", type=int, default=2, help="rollout worker processes")
    p.add_argument("--init", default=None, help="start checkpoint (default: model.init_from, "
                   "else <run.output_dir>/sft/checkpoint if complete, else a random init)")  # fmt: skip
    p.add_argument("--out", default="benchmarks/results/pipeline.json", help="JSON output path")
    p.set_defaults(func=run)


def start_checkpoint(cfg: Any, init: str | None, tmp: Path) -> tuple[str, str]:
    from slipstream.sft import checkpoint_complete, sft_dir

    if init:
        return init, "given"
    if cfg.model.init_from:
        return cfg.model.init_from, "model.init_from"
    sft = sft_dir(cfg) / "checkpoint"
    if checkpoint_complete(sft):
        return str(sft), "sft checkpoint"
    import torch

    from slipstream.model import MoEForCausalLM, save_pretrained
    from slipstream.tasks import get_taskset

    logging.warning(
        "bench pipeline: no SFT checkpoint at %s; using a random init (rewards ~0)", sft
    )
    ts = get_taskset(cfg.task)
    torch.manual_seed(cfg.run.seed)
    model = MoEForCausalLM(cfg.model.model_copy(update={"vocab_size": ts.tokenizer.vocab_size}))
    return str(save_pretrained(model, tmp / "init")), "random init"


def _latency_overrides(base: Any, args: argparse.Namespace) -> tuple[list[str], dict[str, Any]]:
    """Overrides and the JSON description of the verifier latency the run measures."""
    from slipstream.envs import env_needs_sandbox
    from slipstream.rl.verifier import verifies_in_sandbox
    from slipstream.tasks import get_taskset

    verify_sandboxed = verifies_in_sandbox(base.sandbox.verify_in_sandbox, get_taskset(base.task))
    episode_sandboxed = env_needs_sandbox(base.task.env)
    kind = args.verify_latency
    if kind == "auto":
        kind = "real" if verify_sandboxed or episode_sandboxed else "lognormal"
    verifier = f"{base.sandbox.backend} sandbox" if verify_sandboxed else "in-process"
    if episode_sandboxed:
        verifier += f", tool calls in {base.sandbox.backend} sandboxes"
    if kind == "real":
        return ["rollout.verify_latency=none"], {"distribution": "real", "verifier": verifier,
                                                 "sandbox_verified": verify_sandboxed,
                                                 "episode_sandboxed": episode_sandboxed}  # fmt: skip
    return [
        "rollout.verify_latency=lognormal", f"rollout.verify_latency_p50_s={args.verify_p50_s}",
        f"rollout.verify_latency_p99_over_p50={args.verify_p99_over_p50}",
    ], {"distribution": "lognormal", "p50_s": args.verify_p50_s,
        "p99_over_p50": args.verify_p99_over_p50, "verifier": verifier}  # fmt: skip


def steady_samples_per_s(steps: list[dict[str, Any]]) -> float | None:
    """Trained samples per second after the first third of the steps, from the controller's
    cumulative per-step records (`samples_total`, `elapsed_s`); None under 3 steps. Async leases
    max_inflight_tasks x workers groups before its first step (the pipeline fill), work a short
    run never trains on; past it both modes run at the rate the machine sustains."""
    if len(steps) < 3:
        return None
    first, last = steps[len(steps) // 3 - 1], steps[-1]
    if last["elapsed_s"] <= first["elapsed_s"]:
        return None
    return (last["samples_total"] - first["samples_total"]) / (
        last["elapsed_s"] - first["elapsed_s"]
    )


def run_mode(cfg: Any, init: str) -> dict[str, Any]:
    from slipstream.launch.base import make_launcher
    from slipstream.rl.controller import Controller

    controller = Controller(cfg, init)
    launcher = make_launcher(cfg, controller.coord)
    launcher.start()
    try:
        result = controller.run()
    finally:
        launcher.stop()
    steps = [r for r in result.records if "reward_mean" in r]
    tail = steps[-max(1, len(steps) // 3) :]
    return {
        "mode": cfg.trainer.mode,
        "max_staleness": controller.max_staleness,
        "steps": result.steps,
        "wall_s": result.wall_s,
        "samples_per_s": result.samples_per_s,
        "steady_samples_per_s": steady_samples_per_s(steps),
        "trainer_idle_frac": result.trainer_idle_frac,
        "final_reward": sum(r["reward_mean"] for r in tail) / len(tail),
        "pass_at_1_before": result.pass_at_1_before,
        "pass_at_1_after": result.pass_at_1_after,
        "staleness_hist": controller.coord.buffer.metrics()["staleness_hist"],
        "dropped_stale": controller.coord.buffer.metrics()["dropped_stale"],
        "records": steps,
    }


def _trainer_limit(cfg: Any, init: str, results: list[dict[str, Any]]) -> dict[str, Any]:
    """The trainer's limit in samples/s for the runs' mean positions per sample (prompt +
    completion - 1) and batch size, at the job's thread count (bench limits)."""
    from slipstream.bench.limits import measure_limits
    from slipstream.model import load_pretrained
    from slipstream.tasks import get_taskset

    ts = get_taskset(cfg.task)
    tasks = ts.train_batch(0, min(256, ts.num_train))
    prompt = sum(len(ts.prompt_ids(t)) for t in tasks) / len(tasks)
    completion = sum(r["completion_len_mean"] for r in results) / len(results)
    positions = prompt + completion - 1
    samples = cfg.trainer.groups_per_step * cfg.rollout.group_size
    lim = measure_limits(load_pretrained(init).config, num_tokens=max(1, round(samples * positions)),
                         seq_len=positions, parts=("train",),
                         num_threads=cfg.run.num_threads or None)  # fmt: skip
    return {"positions_per_sample": positions, "tokens_per_s": lim.train_tokens_per_s_limit,
            "samples_per_s": lim.train_tokens_per_s_limit / positions, "clock": lim.clock,
            "limits": lim.to_dict()}  # fmt: skip


def _sandbox_limit(cfg: Any, num_pools: int) -> dict[str, Any]:
    """Verifications per second of `num_pools` SandboxVerifiers built as the job's rollout
    workers build theirs (`make_verifier`: one private pool each, the run's [sandbox] section),
    each driven by as many threads as a worker verifies with (min(rollout.verify_threads,
    max_inflight_tasks x group_size)), on the task's reference solutions (`demonstration`),
    all at once in this process. A single-turn sandbox-verified task verifies each sample
    once, so this is the sandbox side's ceiling in samples/s. Not covered: tasks whose episodes
    hold sandboxes for tool calls (their cost per sample depends on the policy's turns)."""
    from concurrent.futures import ThreadPoolExecutor

    from slipstream.rl.verifier import make_verifier
    from slipstream.tasks import get_taskset

    ts = get_taskset(cfg.task)
    threads = max(1, min(cfg.rollout.verify_threads,
                         cfg.rollout.max_inflight_tasks * cfg.rollout.group_size))  # fmt: skip
    num = SANDBOX_LIMIT_VERIFICATIONS_PER_POOL * num_pools
    jobs = [(i % num_pools, ts.train(i % ts.num_train)) for i in range(num)]
    verifiers = []
    try:
        for _ in range(num_pools):
            verifiers.append(make_verifier(cfg.sandbox, ts))
        with ThreadPoolExecutor(threads * num_pools) as ex:
            t0 = time.perf_counter()
            rewards = list(
                ex.map(lambda j: verifiers[j[0]].verify(j[1], ts.reference(j[1]))[0], jobs)
            )
            wall_s = time.perf_counter() - t0
        summaries = [v.summary() for v in verifiers]
    finally:
        for v in verifiers:
            v.close()
    return {"samples_per_s": num / wall_s, "verifications": num, "wall_s": wall_s,
            "pools": num_pools, "threads_per_pool": threads,
            "reward_mean": sum(rewards) / num, "reuse": cfg.sandbox.reuse,
            "sandboxes_created": sum(s.get("created", 0) for s in summaries),
            "verify_latency_p50_s": [s["latency_p50_s"] for s in summaries],
            "verify_latency_p99_s": [s["latency_p99_s"] for s in summaries]}  # fmt: skip


def run(args: argparse.Namespace) -> int:
    from slipstream.config import load_config
    from slipstream.observe.provenance import collect_provenance, write_result

    logging.basicConfig(level=logging.WARNING)
    load_start = os.getloadavg()
    modes = args.modes.split(",")
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-pipeline-") as tmp_s:
        tmp = Path(tmp_s)
        user = [
            *(["task.name=" + args.task] if args.task else []),
            *(["sandbox.backend=" + args.sandbox] if args.sandbox else []),
            *args.overrides,
        ]
        base = load_config(args.config, user)
        latency_overrides, latency = _latency_overrides(base, args)
        print(f"verifier: {latency['verifier']}, latency {latency['distribution']}")
        init, init_kind = start_checkpoint(base, args.init, tmp)
        for mode in modes:
            overrides = [
                *user, f"trainer.mode={mode}", f"trainer.steps={args.steps}",
                f"buffer.max_staleness={args.max_staleness}", f"rollout.num_workers={args.workers}",
                *latency_overrides,
                f"run.output_dir={tmp / mode}", f"store.url={tmp / mode / 'store'}",
                "trainer.checkpoint_every=0", "trainer.eval_every=0",
            ]  # fmt: skip
            cfg = load_config(args.config, overrides)
            t0 = time.monotonic()
            mode_result = run_mode(cfg, init)
            lens = [r["completion_len_mean"] for r in mode_result["records"]]
            mode_result["completion_len_mean"] = sum(lens) / max(1, len(lens))
            del mode_result["records"]  # per-step records: r3's business, not this JSON's
            results.append(mode_result)
            print(f"{mode}: {results[-1]['samples_per_s']:.2f} samples/s, idle "
                  f"{results[-1]['trainer_idle_frac']:.0%} ({time.monotonic() - t0:.0f} s)")  # fmt: skip
        trainer_limit = _trainer_limit(base, init, results)  # while `init` (maybe in tmp) exists
        sandbox_limit = (
            _sandbox_limit(base, args.workers) if latency.get("sandbox_verified") else None
        )
    base_r, fig_r = results[0], results[-1]
    ratio = fig_r["samples_per_s"] / base_r["samples_per_s"]
    steady_ratio = (
        fig_r["steady_samples_per_s"] / base_r["steady_samples_per_s"]
        if fig_r["steady_samples_per_s"] and base_r["steady_samples_per_s"]
        else None
    )
    # Sandbox-bound: the real latency of answers verified in sandboxes or of episodes' tool calls.
    sandbox_bound = latency["distribution"] == "real" and (
        latency["sandbox_verified"] or latency["episode_sandboxed"]
    )
    goal = GOAL_RATIO_SANDBOXED if sandbox_bound else GOAL_RATIO
    record = {
        "benchmark": "pipeline",
        "figure": {"name": f"{fig_r['mode']} samples/s", "value": fig_r["samples_per_s"]},
        "baseline": {"name": f"{base_r['mode']} samples/s", "value": base_r["samples_per_s"]},
        "limit": {"name": "goal ratio figure/baseline", "value": goal},
        "ratio": ratio,
        "steady_ratio": steady_ratio,
        "meets_goal": ratio >= goal,
        "modes": results,
        "verify_latency": latency,
        "start_checkpoint": {"path": init, "kind": init_kind},
        "trainer_limit": trainer_limit,
        "sandbox_limit": sandbox_limit,
        "config": base.model_dump(mode="json"),
        "provenance": collect_provenance({"loadavg_start": load_start,
                                          "loadavg_end": os.getloadavg()}),
    }  # fmt: skip
    out = write_result(args.out, record)
    print(f"\n{'mode':<8} {'samples/s':>10} {'steady':>7} {'idle':>6} {'final reward':>13} "
          f"{'pass@1 after':>13}")  # fmt: skip
    for r in results:
        p1, st = r["pass_at_1_after"], r["steady_samples_per_s"]
        print(f"{r['mode']:<8} {r['samples_per_s']:>10.2f} {'-' if st is None else f'{st:.2f}':>7} "
              f"{r['trainer_idle_frac']:>6.0%} "
              f"{r['final_reward']:>13.3f} {'-' if p1 is None else f'{p1:.3f}':>13}")  # fmt: skip
    lim_sps = trainer_limit["samples_per_s"]
    print(f"trainer limit {lim_sps:,.0f} samples/s ({trainer_limit['positions_per_sample']:.1f} "
          f"positions/sample at {trainer_limit['tokens_per_s']:,.0f} tokens/s, "
          f"{trainer_limit['clock']}): " + ", ".join(
              f"{r['mode']} {r['samples_per_s'] / lim_sps:.1%}" for r in results))  # fmt: skip
    if sandbox_limit is not None:
        sb_sps = sandbox_limit["samples_per_s"]
        print(f"sandbox limit {sb_sps:,.1f} samples/s ({sandbox_limit['verifications']} reference "
              f"solutions verified by {sandbox_limit['pools']} pool(s) x "
              f"{sandbox_limit['threads_per_pool']} threads, reuse={sandbox_limit['reuse']}, "
              f"{sandbox_limit['sandboxes_created']} sandboxes created): " + ", ".join(
                  f"{r['mode']} {r['samples_per_s'] / sb_sps:.0%}" for r in results))  # fmt: skip
    print(f"\nfigure {fig_r['mode']} {fig_r['samples_per_s']:.2f} samples/s | baseline "
          f"{base_r['mode']} {base_r['samples_per_s']:.2f} | ratio {ratio:.2f}x (steady "
          f"{'-' if steady_ratio is None else f'{steady_ratio:.2f}x'}) | goal >= "
          f"{goal}x: {'met' if ratio >= goal else 'NOT met'}\nwrote {out}")  # fmt: skip
    return 0
