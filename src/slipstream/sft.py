"""Supervised warm start: train the MoE policy on a task's demonstrations, save an HF checkpoint.

Shape legend: B batch, T tokens (prompt + completion - 1, right-padded), V vocab.

    result = run_sft(cfg)          # cfg: SlipstreamConfig; returns SFTResult

Each sequence is `<bos> prompt demonstration <eos>`; the loss is next-token cross-entropy on the
completion tokens only (demonstration and EOS), averaged over those tokens in the batch, plus the
model's (already weighted) router auxiliary loss. AdamW, linear warm-up then cosine decay to
`lr * min_lr_ratio`, global-norm gradient clipping. Step s trains on train tasks
[s*B, (s+1)*B), so a run is reproducible from (run.seed, task.seed) on one CPU (float rounding
differs between CPUs' kernels, and so does where SFT ends).

`sft.min_pass_at_1` (off by default) gives RL a starting point less tied to that: after `steps`,
greedy pass@1 on validation prompts (held-out tasks past the first eval.num_prompts, which the
RL job reports, so the reported figure is never tuned on) is checked, and while it is below the
target SFT trains `extend_steps` more at the schedule's final lr, up to `max_extend_rounds`.

Writes: <run.output_dir>/sft/metrics.jsonl (JSON lines), <run.output_dir>/sft/checkpoint/
(config.json + safetensors + tokenizer.json + tokenizer_config.json + sft_summary.json).

Not covered: gradient accumulation, multi-device training, resuming a half-finished SFT run.
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from rich.console import Console

from slipstream.config import ConfigError, SlipstreamConfig
from slipstream.config.sft import SFTConfig
from slipstream.evaluate import pass_at_1_greedy
from slipstream.model.lm_loss import chunked_logprobs
from slipstream.model.tokenizer import Tokenizer
from slipstream.observe.metrics import MetricsWriter, fmt_rate, make_progress
from slipstream.parallel.ranks import clip_grad_norm_
from slipstream.runtime import setup_torch
from slipstream.tasks import Task, TaskSet, get_taskset

if TYPE_CHECKING:
    from slipstream.model import MoEForCausalLM

SUMMARY_FILE = "sft_summary.json"
log = logging.getLogger(__name__)


@dataclass
class SFTResult:
    checkpoint_dir: str
    steps: int
    final_loss: float
    """Mean completion-token loss over the last `log_every` steps (nan when steps == 0)."""
    wall_s: float
    cpu_s: float
    """Process CPU time (all threads): on a shared machine, a contention-free estimate of cost."""
    tokens_per_s: float
    """Non-pad tokens through forward+backward per second (whole run)."""
    validation: list[dict[str, float]] = field(default_factory=list)
    """(step, val_pass_at_1) at each sft.min_pass_at_1 check, in order (empty when off)."""


def sft_dir(cfg: SlipstreamConfig) -> Path:
    return Path(cfg.run.output_dir) / "sft"


def checkpoint_complete(directory: str | Path) -> bool:
    """A finished SFT checkpoint: model config, weights and tokenizer, summary written last."""
    d = Path(directory)
    return (
        (d / "config.json").is_file()
        and (d / "tokenizer.json").is_file()
        and (d / SUMMARY_FILE).is_file()
    )


def build_model(
    cfg: SlipstreamConfig, tokenizer: Tokenizer, device: torch.device, dtype: torch.dtype
) -> MoEForCausalLM:
    """A fresh model from [model] (vocab_size 0 -> the tokenizer's), or `model.init_from` weights."""
    from slipstream.model import MoEForCausalLM, load_pretrained
    from slipstream.model.converters import apply_converters, model_converters

    if cfg.model.init_from:
        model = load_pretrained(cfg.model.init_from, device=device, dtype=dtype)
    else:
        model_cfg = cfg.model.model_copy(deep=True)
        if model_cfg.vocab_size == 0:
            model_cfg.vocab_size = tokenizer.vocab_size
        model = MoEForCausalLM(model_cfg).to(device=device, dtype=dtype)
    if model.config.vocab_size < tokenizer.vocab_size:
        raise ValueError(
            f"model vocab_size {model.config.vocab_size} < tokenizer vocab_size {tokenizer.vocab_size}"
        )
    return apply_converters(model, model_converters(cfg.model.moe_impl))


def collate(
    taskset: TaskSet, tasks: list[Task], device: torch.device, max_observation_tokens: int = 64
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids_BT, target_ids_BT, loss_mask_BT): right-padded; the mask marks target positions
    that are the teacher's completion tokens (what the loss is taken on). Each sequence is the
    teacher's episode in the task's environment (`slipstream.envs.demonstration`): for
    single-turn tasks `<bos> prompt demonstration <eos>`; for multi-turn ones the observation
    tokens between the teacher's turns (tool output) are not in the mask."""
    from slipstream.envs import demonstration

    pad_id = taskset.tokenizer.pad_id
    rows = []
    for task in tasks:
        demo = demonstration(taskset, task, max_observation_tokens)
        rows.append((demo.prompt_ids + demo.completion_ids, len(demo.prompt_ids), demo.loss_mask))
    T = max(len(seq) for seq, _, _ in rows) - 1
    # one tensor per field from Python lists (a few torch calls per row cost 6% of a step)
    inputs, targets, mask = [], [], []
    for seq, prompt_len, loss_mask in rows:
        pad = T - (len(seq) - 1)
        inputs.append(seq[:-1] + [pad_id] * pad)
        targets.append(seq[1:] + [pad_id] * pad)
        # target j is token j+1: the completion starts at prompt_len
        mask.append([False] * (prompt_len - 1) + [bool(m) for m in loss_mask] + [False] * pad)
    inputs_BT = torch.tensor(inputs, dtype=torch.long)
    targets_BT = torch.tensor(targets, dtype=torch.long)
    mask_BT = torch.tensor(mask, dtype=torch.bool)
    return inputs_BT.to(device), targets_BT.to(device), mask_BT.to(device)


def check_fits_context(seq_len: int, cfg: SlipstreamConfig) -> None:
    """Raise ConfigError when a demonstration episode of `seq_len` tokens (`<bos>` to `<eos>`)
    is longer than the model's context. The model's rotary positions would run past it without
    an error, training positions that the engine, `eval` and an exported checkpoint (its
    config.json states the context) never use; so SFT refuses, before its first step for the
    first batch, and on any later batch that has a longer episode."""
    max_pos = cfg.model.max_position_embeddings
    if seq_len > max_pos:
        raise ConfigError(
            f"model.max_position_embeddings = {max_pos}: task.name = {cfg.task.name!r} has a "
            f"demonstration of {seq_len} tokens, longer than the model's context; raise "
            f"model.max_position_embeddings to at least {seq_len}"
        )


def lr_at(step: int, cfg_sft: SFTConfig) -> float:
    """Linear warm-up over warmup_steps, then cosine from lr to lr * min_lr_ratio at the last step."""
    peak = cfg_sft.lr
    if step < cfg_sft.warmup_steps:
        return peak * (step + 1) / cfg_sft.warmup_steps
    decay_steps = max(1, cfg_sft.steps - cfg_sft.warmup_steps)
    progress = min(1.0, (step - cfg_sft.warmup_steps) / decay_steps)
    floor = peak * cfg_sft.min_lr_ratio
    return floor + (peak - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def run_sft(cfg: SlipstreamConfig, console: Console | None = None) -> SFTResult:
    """Train on demonstrations per [sft] and save the checkpoint; see the module docstring."""
    console = console or Console()
    device, dtype = setup_torch(cfg.run)
    taskset = get_taskset(cfg.task)
    model = build_model(cfg, taskset.tokenizer, device, dtype)
    model.train()
    sc = cfg.sft
    # Norms and biases are not decayed (standard practice for transformers).
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": sc.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=sc.lr,
        betas=(0.9, 0.95),
        # one kernel over all parameters, as the RL trainer (rl/trainer.py: 2.5x the per-tensor
        # loop's speed on the quickstart model here)
        fused=device.type in ("cpu", "cuda"),
    )
    out_dir = sft_dir(cfg)
    ckpt_dir = out_dir / "checkpoint"
    console.print(
        f"[bold]sft[/] task={cfg.task.name} params={model.num_parameters() / 1e6:.2f}M "
        f"(active {model.num_parameters(active=True) / 1e6:.2f}M) device={device} dtype={cfg.run.dtype} "
        f"steps={sc.steps} batch={sc.batch_size}"
    )
    start, cpu_start = time.perf_counter(), time.process_time()
    total_tokens = 0
    window = {"loss": 0.0, "steps": 0, "tokens": 0, "start": start}
    final_loss = float("nan")
    validation: list[dict[str, float]] = []
    with MetricsWriter(out_dir / "metrics.jsonl") as metrics, make_progress(console) as progress:
        bar = progress.add_task("sft", total=sc.steps, stats="")

        def train(first: int, last: int) -> None:
            """Optimizer steps [first, last); the lr schedule's floor after sc.steps."""
            nonlocal total_tokens, final_loss
            for step in range(first, last):
                lr = lr_at(step, sc)
                for group in optimizer.param_groups:
                    group["lr"] = lr
                tasks = taskset.train_batch(step * sc.batch_size, sc.batch_size)
                inputs_BT, targets_BT, mask_BT = collate(
                    taskset, tasks, device, cfg.rollout.max_observation_tokens
                )
                check_fits_context(inputs_BT.shape[1] + 1, cfg)
                real_BT = inputs_BT != taskset.tokenizer.pad_id
                chunk = sc.logits_chunk_tokens
                out = model(inputs_BT, skip_padding_BT=real_BT, return_hidden=chunk > 0)
                if chunk > 0:  # cross-entropy over the real positions, chunk by chunk
                    rows_M = out.rows_M
                    logp_M, _ = chunked_logprobs(
                        out.hidden, model.lm_head.weight,
                        targets_BT.reshape(-1).index_select(0, rows_M), chunk_tokens=chunk,
                    )  # fmt: skip
                    mask_M = mask_BT.reshape(-1).index_select(0, rows_M).to(logp_M.dtype)
                    loss = -(logp_M * mask_M).sum() / mask_BT.sum()
                else:
                    ce_BT = F.cross_entropy(
                        out.logits_BTV.flatten(0, 1), targets_BT.flatten(), reduction="none"
                    ).view_as(targets_BT)
                    loss = (ce_BT * mask_BT).sum() / mask_BT.sum()
                optimizer.zero_grad(set_to_none=True)
                (loss + out.aux_loss).backward()
                grad_norm = clip_grad_norm_(list(model.parameters()), sc.grad_clip)
                optimizer.step()

                num_tokens = int(real_BT.sum())
                total_tokens += num_tokens
                window["loss"] += loss.item()
                window["steps"] += 1
                window["tokens"] += num_tokens
                if (step + 1) % sc.log_every == 0 or step + 1 == last:
                    now = time.perf_counter()
                    final_loss = window["loss"] / window["steps"]
                    tok_s = window["tokens"] / max(now - window["start"], 1e-9)
                    metrics.log(
                        step=step + 1,
                        loss=final_loss,
                        aux_loss=float(out.aux_loss.item()),
                        lr=lr,
                        grad_norm=float(grad_norm.item()),
                        tokens_per_s=tok_s,
                        elapsed_s=now - start,
                        cpu_s=time.process_time() - cpu_start,
                    )
                    progress.update(bar, stats=f"loss {final_loss:.3f}  {fmt_rate(tok_s)} tok/s")
                    window.update(loss=0.0, steps=0, tokens=0, start=now)
                progress.advance(bar)

        train(0, sc.steps)
        num_steps = sc.steps
        if sc.min_pass_at_1 > 0:
            val_tasks = taskset.heldout()[cfg.eval.num_prompts :][: sc.val_prompts]
            for round_ in range(sc.max_extend_rounds + 1):
                val = pass_at_1_greedy(model, taskset, val_tasks, cfg)
                model.train()
                validation.append({"step": num_steps, "val_pass_at_1": val})
                metrics.log(
                    step=num_steps, val_pass_at_1=val, elapsed_s=time.perf_counter() - start
                )
                if val >= sc.min_pass_at_1 or round_ == sc.max_extend_rounds:
                    break
                progress.update(bar, total=num_steps + sc.extend_steps,
                                stats=f"val pass@1 {val:.3f} < {sc.min_pass_at_1:g}: +{sc.extend_steps}")  # fmt: skip
                train(num_steps, num_steps + sc.extend_steps)
                num_steps += sc.extend_steps
            if validation[-1]["val_pass_at_1"] < sc.min_pass_at_1:
                log.warning(
                    "sft: validation pass@1 %.3f is still below sft.min_pass_at_1 = %g after "
                    "%d extra steps (sft.max_extend_rounds = %d); RL starts from there",
                    validation[-1]["val_pass_at_1"], sc.min_pass_at_1, num_steps - sc.steps,
                    sc.max_extend_rounds,
                )  # fmt: skip
    wall_s = time.perf_counter() - start
    cpu_s = time.process_time() - cpu_start
    tokens_per_s = total_tokens / max(wall_s, 1e-9)
    result = SFTResult(str(ckpt_dir), num_steps, final_loss, wall_s, cpu_s, tokens_per_s,
                       validation)  # fmt: skip
    save_checkpoint(model, taskset.tokenizer, ckpt_dir, result, cfg)
    checks = "".join(
        f", val pass@1 {v['val_pass_at_1']:.3f} at step {v['step']:.0f}" for v in validation
    )
    console.print(
        f"[bold]sft done[/] {num_steps} steps, loss {final_loss:.4f} in {wall_s:.1f}s (cpu "
        f"{cpu_s:.1f}s, {fmt_rate(result.tokens_per_s)} tok/s){checks} -> {ckpt_dir}"
    )
    return result


def save_checkpoint(
    model: MoEForCausalLM,
    tokenizer: Tokenizer,
    directory: Path,
    result: SFTResult,
    cfg: SlipstreamConfig,
) -> None:
    """HF-format model + tokenizer; the summary goes last so its presence marks completeness."""
    from slipstream.model import save_pretrained

    directory.mkdir(parents=True, exist_ok=True)
    summary = directory / SUMMARY_FILE
    summary.unlink(missing_ok=True)
    save_pretrained(model, directory)
    tokenizer.save(directory)
    summary.write_text(
        json.dumps({"result": asdict(result), "config": cfg.model_dump(mode="json")}, indent=1)
    )
