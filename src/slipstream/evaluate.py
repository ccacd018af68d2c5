"""Held-out evaluation: greedy pass@1 and sampled pass@k of a checkpoint on a task's held-out split.

Shape legend: B batch (sequences decoded together), P prompt length, V vocab.

    report = run_eval(cfg, checkpoint_dir=None)     # -> EvalReport; also printed and saved as JSON

Decoding (`generate`) is a simple batched loop over a StaticKVCache. Prompts are grouped by
length so every row of a batch starts at the same position: no padding, hence no attention mask
is needed and each row's logits equal its unbatched logits. A row stops at EOS (not included in the
completion) or at max_new_tokens. pass@k uses the unbiased estimator of Chen et al. (2021) with
n = eval.num_samples samples per prompt: 1 - C(n-c, k) / C(n, k).

Writes <run.output_dir>/eval/results.json (figures, config, per-prompt samples).
Not covered: top-p/top-k sampling, stop strings, continuous batching (the inference engine's job).
"""

from __future__ import annotations

import json
import time
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from rich.console import Console
from rich.table import Table

from slipstream.config import SlipstreamConfig
from slipstream.model.tokenizer import load_tokenizer
from slipstream.observe.metrics import make_progress
from slipstream.sft import setup_torch, sft_dir
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


@torch.no_grad()
def generate(
    model: torch.nn.Module,
    prompts: list[list[int]],
    max_new_tokens: int,
    eos_id: int,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
    max_batch_size: int = 512,
) -> list[list[int]]:
    """Completion token ids for each prompt (EOS stripped). temperature 0 = greedy."""
    from slipstream.model import StaticKVCache

    device = next(model.parameters()).device
    max_pos = model.config.max_position_embeddings
    by_len: dict[int, list[int]] = defaultdict(list)
    for i, p in enumerate(prompts):
        if not p:
            raise ValueError(f"prompt {i} is empty (it needs at least BOS)")
        by_len[len(p)].append(i)
    results: list[list[int]] = [[] for _ in prompts]
    for plen, idx in sorted(by_len.items()):
        new_tokens = min(max_new_tokens, max_pos - plen)
        if new_tokens <= 0:
            raise ValueError(
                f"prompt of {plen} tokens leaves no room in max_position_embeddings {max_pos}"
            )
        for s in range(0, len(idx), max_batch_size):
            chunk = idx[s : s + max_batch_size]
            prompt_BP = torch.tensor([prompts[i] for i in chunk], device=device)
            rows = _decode(
                model, prompt_BP, new_tokens, eos_id, temperature, generator, StaticKVCache
            )
            for i, row in zip(chunk, rows, strict=True):
                results[i] = row
    return results


def _decode(
    model: MoEForCausalLM,
    prompt_BP: torch.Tensor,
    new_tokens: int,
    eos_id: int,
    temperature: float,
    generator: torch.Generator | None,
    cache_cls: type,
) -> list[list[int]]:
    B, P = prompt_BP.shape
    cache = cache_cls.for_model(model, B, P + new_tokens)
    logits_BV = model(prompt_BP, cache=cache).logits_BTV[:, -1]
    done_B = torch.zeros(B, dtype=torch.bool, device=prompt_BP.device)
    steps = []
    for t in range(new_tokens):
        if temperature > 0:
            probs_BV = torch.softmax(logits_BV / temperature, dim=-1)
            next_B = torch.multinomial(probs_BV, 1, generator=generator).squeeze(1)
        else:
            next_B = logits_BV.argmax(dim=-1)
        next_B = torch.where(done_B, torch.full_like(next_B, eos_id), next_B)
        steps.append(next_B)
        done_B |= next_B == eos_id
        if bool(done_B.all()) or t + 1 == new_tokens:
            break
        logits_BV = model(next_B[:, None], cache=cache).logits_BTV[:, -1]
    tokens_BN = torch.stack(steps, dim=1).tolist()
    return [row[: row.index(eos_id)] if eos_id in row else row for row in tokens_BN]


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
    cfg: SlipstreamConfig, checkpoint_dir: str | Path | None = None, console: Console | None = None
) -> EvalReport:
    """Evaluate per [eval]; prints a table and writes <run.output_dir>/eval/results.json."""
    console = console or Console()
    ec = cfg.eval
    checkpoint = Path(checkpoint_dir or ec.checkpoint or sft_dir(cfg) / "checkpoint")
    if not (checkpoint / "config.json").is_file():
        raise FileNotFoundError(f"no checkpoint at {checkpoint} (run `slipstream sft` first?)")
    start = time.perf_counter()
    model, taskset, device = load_for_eval(checkpoint, cfg)
    tasks = taskset.heldout()[: ec.num_prompts]
    prompts = [taskset.prompt_ids(t) for t in tasks]
    n = ec.num_samples or ec.k
    eos = taskset.tokenizer.eos_id
    gen = torch.Generator(device=device).manual_seed(cfg.run.seed)
    with make_progress(console) as progress:
        bar = progress.add_task(
            "eval", total=2, stats=f"{len(tasks)} prompts, greedy + {n} samples"
        )
        greedy = _score(
            taskset,
            tasks,
            generate(model, prompts, ec.max_new_tokens, eos, 0.0, None, ec.batch_size),
        )
        progress.advance(bar)
        sampled_ids = generate(
            model,
            [p for p in prompts for _ in range(n)],
            ec.max_new_tokens,
            eos,
            ec.temperature,
            gen,
            ec.batch_size,
        )
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
