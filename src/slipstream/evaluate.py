"""Held-out evaluation: greedy pass@1 and sampled pass@k of a checkpoint on a task's held-out split.

Shape legend: B batch (sequences decoded together), P prompt length, V vocab.

    report = run_eval(cfg, checkpoint_dir)          # -> EvalReport; also printed and saved as JSON

Decoding (`decode`) runs through the rollout engine (`NativeEngine`) on the given model, so the
policy is evaluated by the same decoder, KV cache and sampler that produce its rollouts: greedy
for pass@1 (argmax of each row's logits, which equal its unbatched logits within float
rounding), and seeded sampling at eval.temperature for pass@k (n = eval.num_samples samples per
prompt, a group sharing its prompt's prefill). A completion stops at EOS (not included) or at
max_new_tokens. pass@k uses the unbiased estimator of Chen et al. (2021):
1 - C(n-c, k) / C(n, k).

`heldout_pass_at_1(model, taskset, cfg)` is what the RL job reports before, during and after
training; `run_eval(cfg)` is `slipstream eval`. A task whose environment is multi-turn
(`task.env` other than `single_turn`) is evaluated by running its episodes (`episode_eval`: the
rollout workers' episode loop, through a NativeEngine with the environment's stop strings and,
when the environment needs them, sandboxes from a pool built from [sandbox] for the call); a
single-turn task by `decode` + the verifier, as before. Writes <run.output_dir>/eval/results.json
(figures, config, per-prompt samples). Not covered: top-p/top-k at evaluation, stop strings.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from rich.console import Console
from rich.table import Table

from slipstream.config import SlipstreamConfig
from slipstream.model.tokenizer import load_tokenizer
from slipstream.observe.metrics import make_progress
from slipstream.runtime import setup_torch
from slipstream.tasks import Task, TaskSet, get_taskset

if TYPE_CHECKING:
    from slipstream.model import MoEForCausalLM


@dataclass
class EvalReport:
    checkpoint: str
    task: str
    num_prompts: int
    pass_at_1_greedy: float
    pass_at_1_sampled: float
    pass_at_k: float
    k: int
    num_samples: int
    temperature: float
    wall_s: float
    greedy_reasons: dict[str, int] = field(default_factory=dict)
    """Verifier reasons of the greedy completions, most common first (reason text truncated)."""


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct."""
    if n < k:
        raise ValueError(f"pass@{k} needs at least {k} samples, got {n}")
    if n - c < k:
        return 1.0
    prob_all_wrong = 1.0
    for i in range(n - c + 1, n + 1):
        prob_all_wrong *= 1.0 - k / i
    return 1.0 - prob_all_wrong


def decode(
    model: MoEForCausalLM,
    prompts: list[list[int]],
    max_new_tokens: int,
    eos_id: int,
    *,
    temperature: float = 0.0,
    num_samples: int = 1,
    seed: int = 0,
    max_batch_size: int = 512,
) -> list[list[int]]:
    """Completion token ids (EOS stripped) of each prompt, `num_samples` per prompt in prompt
    order (greedy when temperature is 0), decoded by a NativeEngine over `model` that lives for
    this call. The model is left in the train/eval mode it came in."""
    from slipstream.config.engine import EngineConfig
    from slipstream.engine import GenerateRequest, SamplingParams, build_engine

    if not prompts:
        return []
    if any(not p for p in prompts):
        raise ValueError("every prompt needs at least one token (BOS)")
    max_pos = model.config.max_position_embeddings
    longest = max(len(p) for p in prompts)
    if longest >= max_pos:
        raise ValueError(
            f"a prompt of {longest} tokens leaves no room to generate in the model's context of "
            f"{max_pos} positions (model.max_position_embeddings); raise it or use shorter prompts"
        )
    slot_len = min(max_pos, max(len(p) for p in prompts) + max_new_tokens)
    num_slots = max(num_samples, min(max_batch_size, len(prompts) * num_samples))
    engine_cfg = EngineConfig(
        max_batch_size=num_slots, kv_cache_tokens=max(64, num_slots * slot_len),
        max_seq_len=slot_len, max_new_tokens=max_new_tokens,
        device=str(next(model.parameters()).device),
    )  # fmt: skip
    requests = [
        GenerateRequest(
            p,
            SamplingParams(
                temperature=temperature,
                max_new_tokens=min(max_new_tokens, slot_len - len(p)),
                n=num_samples,
                seed=None if temperature == 0 else seed * 1_000_003 + i,
            ),
        )  # fmt: skip
        for i, p in enumerate(prompts)
    ]
    was_training = model.training
    engine = build_engine(engine_cfg, model, eos_token_ids=[eos_id])
    try:
        completions = engine.generate(requests)
    finally:
        engine.close()
        model.train(was_training)
    out = []
    for c in completions:
        ids = c.token_ids
        out.append(ids[: ids.index(eos_id)] if eos_id in ids else ids)
    return out


def episode_eval(
    model: MoEForCausalLM, taskset: TaskSet, cfg: SlipstreamConfig, tasks: list[Task], *,
    temperature: float = 0.0, num_samples: int = 1, seed: int = 0,
) -> list[list[tuple[float, str, str]]]:  # fmt: skip
    """(reward, reason, text) of `num_samples` episodes per task in the task's environment
    (greedy when temperature is 0), each turn at most eval.max_new_tokens tokens, the other
    episode bounds from [rollout]. Sandboxes (when the environment needs them) come from a pool
    that lives for this call (or leased from the node's host agent, `rollout.sandbox_agent`).
    Raises RuntimeError naming the task when a group did not finish
    (e.g. infrastructure failures beyond rollout.max_infra_retries)."""
    from concurrent.futures import ThreadPoolExecutor

    from slipstream.config.engine import EngineConfig
    from slipstream.engine import build_engine
    from slipstream.envs import (
        EpisodeLimits,
        EpisodeRunner,
        env_needs_sandbox,
        make_env_factory,
        run_episodes,
    )
    from slipstream.envs.sandboxes import SandboxHost
    from slipstream.envs.single_turn import taskset_scorer

    if not tasks:
        return []
    limits = EpisodeLimits.from_config(cfg.rollout, cfg.eval.max_new_tokens)
    slot_len = model.config.max_position_embeddings
    slots = max(num_samples, min(cfg.eval.batch_size, len(tasks) * num_samples))
    engine_cfg = EngineConfig(max_batch_size=slots, kv_cache_tokens=max(64, slots * slot_len),
                              max_seq_len=slot_len, max_new_tokens=cfg.eval.max_new_tokens,
                              device=str(next(model.parameters()).device))  # fmt: skip
    host = (
        SandboxHost.from_config(cfg.sandbox, cfg.rollout.sandbox_agent).start()
        if env_needs_sandbox(taskset.cfg.env)
        else None
    )
    was_training = model.training
    engine = build_engine(engine_cfg, model, tokenizer=taskset.tokenizer)
    try:
        with ThreadPoolExecutor(max(1, cfg.rollout.verify_threads), "eval-env") as pool:
            agent = None
            if taskset.cfg.env == "agent":  # the user's agent drives the episodes
                from slipstream.envs.agent import AgentRuntime

                agent = AgentRuntime(engine, taskset, cfg.agent, limits,
                                     scorer=taskset_scorer(taskset), temperature=temperature,
                                     context_tokens=engine.max_seq_len)  # fmt: skip
                make_env = agent.factory()
            else:
                make_env = make_env_factory(taskset, scorer=taskset_scorer(taskset),
                                            sandboxes=host, limits=limits)  # fmt: skip
            runner = EpisodeRunner(engine, make_env, taskset.tokenizer, limits, pool,
                                   temperature=temperature, context_tokens=engine.max_seq_len)  # fmt: skip
            try:
                outcomes = run_episodes(runner, tasks, num_samples,
                                        seed=None if temperature == 0 else seed)  # fmt: skip
            finally:
                runner.close()
                if agent is not None:
                    agent.close()
    finally:
        engine.close()
        model.train(was_training)
        if host is not None:
            host.close()
    out = []
    for task, o in zip(tasks, outcomes, strict=True):
        if o.status != "done":
            raise RuntimeError(f"evaluation of {task.task_id} ended {o.status}: {o.error}")
        out.append([(e.reward, e.reason, e.text) for e in o.episodes])
    return out


def heldout_pass_at_1(model: MoEForCausalLM, taskset: TaskSet, cfg: SlipstreamConfig) -> float:
    """Greedy pass@1 on the first eval.num_prompts held-out tasks (what the RL job reports)."""
    return pass_at_1_greedy(model, taskset, taskset.heldout()[: cfg.eval.num_prompts], cfg)


def pass_at_1_greedy(
    model: MoEForCausalLM, taskset: TaskSet, tasks: list[Task], cfg: SlipstreamConfig
) -> float:
    """Greedy pass@1 on `tasks` (episodes for multi-turn environments)."""
    if taskset.cfg.env != "single_turn":
        results = episode_eval(model, taskset, cfg, tasks)
        return sum(r[0][0] for r in results) / len(tasks)
    outs = decode(model, [taskset.prompt_ids(t) for t in tasks], cfg.eval.max_new_tokens,
                  taskset.tokenizer.eos_id, max_batch_size=cfg.eval.batch_size)  # fmt: skip
    correct = sum(
        taskset.verify(t, taskset.tokenizer.decode(o)).reward
        for t, o in zip(tasks, outs, strict=True)
    )
    return correct / len(tasks)


def load_for_eval(
    checkpoint: str | Path, cfg: SlipstreamConfig
) -> tuple[MoEForCausalLM, TaskSet, torch.device]:
    """(model in eval mode, taskset using the checkpoint's tokenizer, device)."""
    from slipstream.model import load_pretrained

    device, dtype = setup_torch(cfg.run)
    tokenizer = load_tokenizer(checkpoint)
    model = load_pretrained(str(checkpoint), device=device, dtype=dtype)
    model.eval()
    return model, get_taskset(cfg.task, tokenizer), device


def _score(
    taskset: TaskSet, tasks: list[Task], completions: list[list[int]]
) -> list[tuple[float, str, str]]:
    out = []
    for task, ids in zip(tasks, completions, strict=True):
        text = taskset.tokenizer.decode(ids)
        reward, reason = taskset.verify(task, text)
        out.append((reward, reason, text))
    return out


def run_eval(
    cfg: SlipstreamConfig, checkpoint_dir: str | Path, console: Console | None = None
) -> EvalReport:
    """Evaluate an HF-format checkpoint directory per [eval]; prints a table and writes
    <run.output_dir>/eval/results.json."""
    console = console or Console()
    ec = cfg.eval
    checkpoint = Path(checkpoint_dir)
    if not (checkpoint / "config.json").is_file():
        raise FileNotFoundError(f"no checkpoint at {checkpoint} (run `slipstream sft` first?)")
    start = time.perf_counter()
    model, taskset, _ = load_for_eval(checkpoint, cfg)
    tasks = taskset.heldout()[: ec.num_prompts]
    prompts = [taskset.prompt_ids(t) for t in tasks]
    n = ec.num_samples or ec.k
    eos = taskset.tokenizer.eos_id
    multi_turn = taskset.cfg.env != "single_turn"
    with make_progress(console) as progress:
        bar = progress.add_task(
            "eval", total=2, stats=f"{len(tasks)} prompts, greedy + {n} samples"
        )
        if multi_turn:
            greedy = [r[0] for r in episode_eval(model, taskset, cfg, tasks)]
        else:
            greedy_ids = decode(
                model, prompts, ec.max_new_tokens, eos, max_batch_size=ec.batch_size
            )
            greedy = _score(taskset, tasks, greedy_ids)
        progress.advance(bar)
        if multi_turn:
            sampled = [r for rs in episode_eval(model, taskset, cfg, tasks, temperature=ec.temperature,
                                                num_samples=n, seed=cfg.run.seed) for r in rs]  # fmt: skip
        else:
            sampled_ids = decode(model, prompts, ec.max_new_tokens, eos, temperature=ec.temperature,
                                 num_samples=n, seed=cfg.run.seed, max_batch_size=ec.batch_size)  # fmt: skip
            sampled = _score(taskset, [t for t in tasks for _ in range(n)], sampled_ids)
        progress.advance(bar)
    num_correct = [sum(r for r, _, _ in sampled[i * n : (i + 1) * n]) for i in range(len(tasks))]
    reasons = Counter(_reason_class(reason) for _, reason, _ in greedy)
    report = EvalReport(
        checkpoint=str(checkpoint),
        task=cfg.task.name,
        num_prompts=len(tasks),
        pass_at_1_greedy=sum(r for r, _, _ in greedy) / len(tasks),
        pass_at_1_sampled=sum(num_correct) / (n * len(tasks)),
        pass_at_k=sum(pass_at_k(n, int(c), ec.k) for c in num_correct) / len(tasks),
        k=ec.k,
        num_samples=n,
        temperature=ec.temperature,
        wall_s=time.perf_counter() - start,
        greedy_reasons=dict(reasons.most_common()),
    )
    samples = [
        {
            "task_id": t.task_id,
            "prompt": t.prompt,
            "greedy": g[2],
            "reward": g[0],
            "reason": g[1],
            "sampled_correct": int(c),
        }
        for t, g, c in zip(tasks, greedy, num_correct, strict=True)
    ]
    write_report(cfg, report, samples)
    print_report(report, console)
    return report


def _reason_class(reason: str) -> str:
    """Group reasons such as "wrong answer: got 12, expected 13" by their text before ':'."""
    return reason.split(":", 1)[0]


def write_report(cfg: SlipstreamConfig, report: EvalReport, samples: list[dict[str, Any]]) -> Path:
    path = Path(cfg.run.output_dir) / "eval" / "results.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"report": asdict(report), "config": cfg.model_dump(mode="json"), "samples": samples}
    path.write_text(json.dumps(payload, indent=1))
    return path


def print_report(report: EvalReport, console: Console) -> None:
    table = Table(title=f"held-out eval: {report.task}, {report.num_prompts} prompts")
    table.add_column("metric")
    table.add_column("value", justify="right")
    table.add_row("pass@1 (greedy)", f"{100 * report.pass_at_1_greedy:.1f}%")
    table.add_row(
        f"pass@1 (sampled, T={report.temperature:g})", f"{100 * report.pass_at_1_sampled:.1f}%"
    )
    table.add_row(f"pass@{report.k} (n={report.num_samples})", f"{100 * report.pass_at_k:.1f}%")
    table.add_row("wall time", f"{report.wall_s:.1f} s")
    for reason, count in list(report.greedy_reasons.items())[:4]:
        table.add_row(f"greedy: {reason}", str(count))
    console.print(table)
