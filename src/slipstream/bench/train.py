"""`slipstream bench train`: trainer tokens/s of one RL step and one SFT step, against this
machine's limit for the same tokens (bench limits), with a torch.profiler table of one step.

Models: the config's (-c, default the quickstart: hidden 128, 4 layers, 8 experts top-2) and
bench engine's "larger" (hidden 256, 8 layers, 16 experts top-2), random init, vocab of the
task's tokenizer, run.num_threads threads (the quickstart's 1).
- RL step: the real `Trainer.step` (rl/trainer.py, built by `build_trainer` from the config)
  on batches shaped like the job's: trainer.groups_per_step groups of rollout.group_size
  samples, prompts of the task's train split, completions the task's demonstrations (answer +
  EOS, some samples given another task's answer so lengths and rewards vary), behaviour
  logprobs and versions of a fresh policy (staleness 0). The figure: non-pad positions
  (prompt + completion - 1 per sample) per second of `step()`; publishing is not in it.
- SFT step: the real `run_sft` loop (sft.py) for (1 + repeats) x --steps steps, its own
  tokens/s per window of --steps steps (log_every = --steps; the first window is warm-up); the
  step after them is profiled (steps are delimited by a global forward pre-hook on the policy,
  so nothing of sft.py is reimplemented here).
Repeats: --repeats windows of --steps steps after --warmup; printed as median and range, on
wall time and per CPU second of the process (on a loaded shared host the CPU figure is the
contention-free one; the limit is measured on thread CPU time when the job runs 1 thread).
Limit: `measure_limits` for the mean tokens per step and positions per sequence of the run
(a trainer with no padding and no per-op overhead; bench/limits.py). --profile-steps steps after
the timed ones are profiled one by one and summarised in the JSON (bench/profile_summary.py: the
median of each series over them, so an op the OS preempted in one step does not dominate);
`<out stem>-profile-<model>-<kind>.txt` next to the JSON holds that summary and torch's table
(by self CPU time) of the step of median wall time.

Not covered: PPO, KL reference, minibatches > 1 (the config's trainer settings are used as they
are), data-parallel or sharded layouts (bench moe-train), CUDA (never run here).
"""

from __future__ import annotations

import argparse
import io
import os
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from slipstream.config.args import add_config_args


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="trainer tokens/s of an RL step and an SFT step vs the "
                       "measured limit, with a profile of one step", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    add_config_args(p)
    p.add_argument("--models", default="config,larger", help="comma list: config, larger")
    p.add_argument("--kinds", default="rl,sft", help="comma list: rl, sft")
    p.add_argument("--steps", type=int, default=5, help="steps per timed repeat")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=2, help="untimed RL steps first")
    p.add_argument("--threads", type=int, default=0, help="0: run.num_threads")
    p.add_argument("--profile-steps", type=_non_negative, default=3,
                   help="steps profiled after the timed ones (summaries: the median per series); "
                        "0: no profile")  # fmt: skip
    p.add_argument("--out", default="benchmarks/results/train.json", help="JSON output path")
    # GPU-scale presets (bench/train_preset.py): instead of the config's models
    p.add_argument("--preset", default="", help="mid | qwen3-30b-a3b-4l | tiny: the trainer at "
                   "that shape on --device (bench/train_preset.py), not the config's models")  # fmt: skip
    p.add_argument("--device", default="cpu", help="--preset only: cpu or cuda[:i]")
    p.add_argument("--batch", type=int, default=16, help="--preset only: sequences per step")
    p.add_argument("--seq-len", type=int, default=1024, help="--preset only: positions each")
    p.add_argument(
        "--precision",
        default="",
        choices=["", "fp32", "bf16", "fp16"],
        help="--preset only: compute dtype (default bf16 on CUDA, fp32 on CPU)",
    )
    p.add_argument("--activation-checkpointing", action="store_true", help="--preset only")
    p.add_argument("--compile-blocks", action="store_true", help="--preset only (CUDA)")
    p.add_argument(
        "--no-hf",
        dest="hf",
        action="store_false",
        help="--preset only: skip transformers' Qwen3MoeForCausalLM baseline",
    )
    p.set_defaults(func=run)


def _rl_batches(taskset: Any, num: int, groups: int, group_size: int, seed: int) -> list[Any]:
    from slipstream.rl.types import Batch, Group, Sample, TaskRef

    rng = random.Random(seed)
    out = []
    for step in range(num):
        grs = []
        for g in range(groups):
            index = rng.randrange(taskset.num_train)
            task = taskset.train(index)
            prompt = taskset.prompt_ids(task)
            samples = []
            for i in range(group_size):
                right = i % 2 == 0
                other = task if right else taskset.train(rng.randrange(taskset.num_train))
                completion = taskset.completion_ids(taskset.demonstration(other))
                samples.append(Sample(prompt_ids=prompt, completion_ids=completion,
                                      behaviour_logprobs=[-0.5] * len(completion),
                                      versions=[0] * len(completion),
                                      reward=float(right)))  # fmt: skip
            grs.append(Group(TaskRef(task_id=step * groups + g, index=index), samples))
        out.append(Batch(grs, trainer_version=0, staleness=[0] * groups))
    return out


def _positions(batch: Any) -> tuple[int, int]:
    """(non-pad positions, padded positions B x T) of a batch as the trainer collates it."""
    lens = [len(s.prompt_ids) + len(s.completion_ids) - 1 for s in batch.samples]
    return sum(lens), len(lens) * max(lens)


def _profile(fn: Any) -> Any:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return prof


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def measure_rl(cfg: Any, init_dir: str, taskset: Any, args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from slipstream.rl.trainer import build_trainer

    trainer = build_trainer(cfg, init_dir, torch.device("cpu"), taskset.tokenizer.pad_id)
    tc = cfg.trainer
    per_window = args.steps
    timed = args.warmup + args.repeats * per_window  # the batches after these are profiled
    batches = _rl_batches(taskset, timed + args.profile_steps, tc.groups_per_step,
                          cfg.rollout.group_size, cfg.run.seed)  # fmt: skip
    for b in batches[: args.warmup]:
        trainer.step(b)
    windows = []
    for r in range(args.repeats):
        chunk = batches[args.warmup + r * per_window : args.warmup + (r + 1) * per_window]
        t0, c0 = time.perf_counter(), time.process_time()
        for b in chunk:
            trainer.step(b)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        real = sum(_positions(b)[0] for b in chunk)
        padded = sum(_positions(b)[1] for b in chunk)
        windows.append({"wall_s": wall, "cpu_s": cpu, "steps": len(chunk),
                        "tokens_per_s": real / wall, "cpu_tokens_per_s": real / cpu,
                        "padded_tokens_per_s": padded / wall,
                        "tokens_per_step": real / len(chunk),
                        "padding_frac": 1 - real / padded})  # fmt: skip
    profs = [_profile(lambda b=b: trainer.step(b)) for b in batches[timed:]]
    samples_per_step = tc.groups_per_step * cfg.rollout.group_size
    return {"windows": windows, "profiles": profs, "samples_per_step": samples_per_step}


def measure_sft(cfg: Any, out_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    from rich.console import Console
    from torch.nn.modules.module import register_module_forward_pre_hook
    from torch.profiler import ProfilerActivity, profile

    from slipstream.model import MoEForCausalLM
    from slipstream.observe.metrics import read_metrics
    from slipstream.sft import run_sft

    k = args.steps
    timed = (1 + args.repeats) * k  # the first window is warm-up
    cfg = cfg.model_copy(deep=True)
    n = args.profile_steps
    cfg.sft.steps, cfg.sft.log_every = timed + n + 1, k
    cfg.sft.min_pass_at_1 = 0.0  # only the fixed-step loop is timed (no validation decode)
    cfg.run.output_dir = str(out_dir)
    profs = [profile(activities=[ProfilerActivity.CPU]) for _ in range(n)]
    forwards = 0

    def on_forward(module: Any, inputs: Any) -> None:
        # Steps of the real loop are delimited by the policy's forward calls (outside every
        # record_function range), so profile j holds exactly step timed + 1 + j, optimizer
        # included.
        nonlocal forwards
        if not isinstance(module, MoEForCausalLM):
            return
        forwards += 1
        j = forwards - timed - 1
        if 0 < j <= n:
            profs[j - 1].stop()
        if 0 <= j < n:
            profs[j].start()

    handle = register_module_forward_pre_hook(on_forward)
    try:
        run_sft(cfg, Console(file=io.StringIO()))
    finally:
        handle.remove()
    if forwards != timed + n + 1:
        raise RuntimeError(f"bench train: the SFT loop ran {forwards} policy forwards for "
                           f"{timed + n + 1} steps; cannot delimit its steps")  # fmt: skip
    recs = [r for r in read_metrics(out_dir / "sft" / "metrics.jsonl") if "tokens_per_s" in r]
    windows = []
    prev, prev_cpu = recs[0]["elapsed_s"], recs[0]["cpu_s"]
    for r in recs[1 : 1 + args.repeats]:
        wall, cpu = r["elapsed_s"] - prev, r["cpu_s"] - prev_cpu
        prev, prev_cpu = r["elapsed_s"], r["cpu_s"]
        tokens = r["tokens_per_s"] * wall
        windows.append({"wall_s": wall, "cpu_s": cpu, "steps": k,
                        "tokens_per_s": r["tokens_per_s"], "cpu_tokens_per_s": tokens / cpu,
                        "tokens_per_step": tokens / k})  # fmt: skip
    return {"windows": windows, "profiles": profs, "samples_per_step": cfg.sft.batch_size}


def _save_init(cfg: Any, taskset: Any, directory: Path) -> str:
    import torch

    from slipstream.model import MoEForCausalLM, save_pretrained

    torch.manual_seed(cfg.run.seed)
    model_cfg = cfg.model.model_copy(update={"vocab_size": taskset.tokenizer.vocab_size})
    return str(save_pretrained(MoEForCausalLM(model_cfg), directory))


def _spread(windows: list[dict[str, Any]], key: str) -> dict[str, float]:
    vals = [w[key] for w in windows]
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals)}


def run(args: argparse.Namespace) -> int:
    if args.preset:
        from slipstream.bench.train_preset import run_preset

        return run_preset(args)
    import torch

    from slipstream.bench.models import MODELS
    from slipstream.config import load_config
    from slipstream.observe.provenance import collect_provenance, write_result
    from slipstream.tasks import get_taskset

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)  # the profiles are written before the JSON
    load_start = os.getloadavg()
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-train-") as tmp_s:
        tmp = Path(tmp_s)
        for name in args.models.split(","):
            if name != "config" and name not in MODELS:
                raise ValueError(f"--models: {name!r} unknown; expected config or {list(MODELS)}")
            preset = [] if name == "config" else [f"model.{k}={v}" for k, v in MODELS[name].items()]
            cfg = load_config(args.config, [*args.overrides, *preset])
            threads = args.threads or cfg.run.num_threads or torch.get_num_threads()
            torch.set_num_threads(threads)
            taskset = get_taskset(cfg.task)
            model_cfg = cfg.model.model_copy(update={"vocab_size": taskset.tokenizer.vocab_size})
            init = _save_init(cfg, taskset, tmp / name / "init")
            for kind in args.kinds.split(","):
                if kind == "rl":
                    m = measure_rl(cfg, init, taskset, args)
                elif kind == "sft":
                    m = measure_sft(cfg, tmp / name / "sft", args)
                else:
                    raise ValueError(f"--kinds: {kind!r} unknown; expected rl or sft")
                rows.append(_report(name, kind, model_cfg, m, threads, out))
    record = {
        "benchmark": "train",
        "metric": "trainer tokens/s (non-pad positions through forward + backward + optimizer)",
        "settings": {k: v for k, v in vars(args).items() if k != "func"},
        "results": rows,
        "provenance": collect_provenance({"loadavg_start": load_start,
                                          "loadavg_end": os.getloadavg()}),
    }  # fmt: skip
    write_result(out, record)
    print(f"\n{'model':<8} {'kind':<4} {'tokens/s (wall): median, range':>31} "
          f"{'per CPU s: median, range':>26} {'limit':>7} {'wall':>6} {'CPU':>6} {'pad':>4}")  # fmt: skip
    for r in rows:
        f, c = r["tokens_per_s"], r["cpu_tokens_per_s"]
        pad = r.get("padding_frac")
        rng_f = f"{f['median']:,.0f}, {f['min']:,.0f}-{f['max']:,.0f}"
        rng_c = f"{c['median']:,.0f}, {c['min']:,.0f}-{c['max']:,.0f}"
        print(f"{r['model']:<8} {r['kind']:<4} {rng_f:>31} {rng_c:>26} "
              f"{r['limit_tokens_per_s']:>7,.0f} {r['fraction_of_limit']:>6.1%} "
              f"{r['cpu_fraction_of_limit']:>6.1%} {'-' if pad is None else f'{pad:.0%}':>4}")  # fmt: skip
    print(
        "(limit: the same tokens per step at this machine's measured GEMM and AdamW speed; "
        "wall / CPU: the figure over it, on wall time and per CPU second)"
    )
    print(f"load average {load_start[0]:.1f} -> {os.getloadavg()[0]:.1f}\nwrote {out}")
    return 0


def _report(name: str, kind: str, model_cfg: Any, m: dict[str, Any], threads: int,
            out: Path) -> dict[str, Any]:  # fmt: skip
    """The figure, its limit and the profile summary of one model x kind; prints them."""
    from slipstream.bench.limits import measure_limits
    from slipstream.bench.profile_summary import combine, format_summary, summarize

    windows = m["windows"]
    tokens_per_step = statistics.mean(w["tokens_per_step"] for w in windows)
    seq_len = tokens_per_step / m["samples_per_step"]
    lim = measure_limits(model_cfg, num_tokens=max(1, round(tokens_per_step)), seq_len=seq_len,
                         parts=("train",), num_threads=threads)  # fmt: skip
    fig = _spread(windows, "tokens_per_s")
    cpu_fig = _spread(windows, "cpu_tokens_per_s")
    summaries = [summarize(p, lim.op_overhead_s["add_s"]) for p in m["profiles"]]
    summary, prof_path, profile_text = None, None, "no step profiled (--profile-steps 0)"
    if summaries:
        summary = combine(summaries)
        walls = [x["wall_s"] for x in summaries]
        median_step = m["profiles"][walls.index(sorted(walls)[len(walls) // 2])]
        table = median_step.key_averages().table(sort_by="self_cpu_time_total", row_limit=40)
        prof_path = out.with_name(f"{out.stem}-profile-{name}-{kind}.txt")
        prof_path.write_text(f"bench train: {name} {kind} step, {threads} thread(s); median of "
                             f"{len(summaries)} profiled steps:\n{format_summary(summary)}\n\n"
                             f"the step of median wall time, by self CPU time:\n{table}\n")  # fmt: skip
        profile_text = f"{format_summary(summary)}\nprofile table: {prof_path}"
    row = {
        "model": name, "kind": kind, "model_config": model_cfg.model_dump(),
        "threads": threads, "windows": windows, "tokens_per_s": fig,
        "tokens_per_step": tokens_per_step, "seq_len": seq_len,
        "limit_tokens_per_s": lim.train_tokens_per_s_limit,
        "fraction_of_limit": fig["median"] / lim.train_tokens_per_s_limit,
        "cpu_tokens_per_s": cpu_fig,
        "cpu_fraction_of_limit": cpu_fig["median"] / lim.train_tokens_per_s_limit,
        "limit": lim.to_dict(), "profile_summary": summary,
        "profile_table": None if prof_path is None else str(prof_path),
    }  # fmt: skip
    if "padding_frac" in windows[0]:
        row["padding_frac"] = statistics.mean(w["padding_frac"] for w in windows)
        row["padded_tokens_per_s"] = _spread(windows, "padded_tokens_per_s")
    print(f"\n== {name} {kind}: {fig['median']:,.0f} tokens/s (range {fig['min']:,.0f}-"
          f"{fig['max']:,.0f}, {len(windows)} x {windows[0]['steps']} steps, "
          f"{tokens_per_step:.0f} tokens/step) = {row['fraction_of_limit']:.1%} of the limit "
          f"{lim.train_tokens_per_s_limit:,.0f} tokens/s ({lim.clock}); per CPU second "
          f"{cpu_fig['median']:,.0f} (range {cpu_fig['min']:,.0f}-{cpu_fig['max']:,.0f}) = "
          f"{row['cpu_fraction_of_limit']:.1%}\n{profile_text}", flush=True)  # fmt: skip
    return row
