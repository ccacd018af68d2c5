"""`slipstream rm train`: a Bradley-Terry reward model from preference pairs.

    result = train_reward_model(cfg)      # -> RMResult; checkpoint in <run.output_dir>/rm/checkpoint

Loss: -log sigmoid(r(prompt + chosen) - r(prompt + rejected)), mean over the step's pairs, plus
the backbone's (already weighted) router auxiliary loss. A step's 2 x batch_size sequences run as
one right-padded batch whose per-token layers skip the padding. AdamW, linear warm-up then
constant lr, global-norm clipping. The pairs are shuffled once (run.seed); the last
rm.heldout_fraction of them are never trained on, and pairwise accuracy on them (ties count as
wrong) is reported before and after training.

Writes <run.output_dir>/rm/metrics.jsonl and <run.output_dir>/rm/checkpoint/ (HF
`Qwen3MoeForSequenceClassification`: config.json, model.safetensors, tokenizer files,
rm_summary.json written last). Not covered: multi-device training, margin / ties in the data,
gradient accumulation.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from rich.console import Console

from slipstream.config import SlipstreamConfig
from slipstream.model.tokenizer import Tokenizer, load_tokenizer
from slipstream.observe.metrics import MetricsWriter
from slipstream.parallel.ranks import clip_grad_norm_
from slipstream.rm.model import (
    SUMMARY_FILE,
    MoERewardModel,
    is_reward_checkpoint,
    load_reward_model,
    pad_batch,
    save_reward_model,
    score_ids,
)
from slipstream.rm.pairs import Pair, PairsError, make_task_pairs, read_pairs
from slipstream.runtime import setup_torch

log = logging.getLogger(__name__)


@dataclass
class RMResult:
    checkpoint_dir: str
    steps: int
    train_pairs: int
    heldout_pairs: int
    heldout_accuracy_init: float
    """Pairwise accuracy on the held-out pairs before training."""
    heldout_accuracy: float
    """... and after: the figure `rm train` reports."""
    final_loss: float
    wall_s: float


def rm_dir(cfg: SlipstreamConfig) -> Path:
    return Path(cfg.run.output_dir) / "rm"


def pairs_path(cfg: SlipstreamConfig) -> Path:
    return Path(cfg.rm.pairs) if cfg.rm.pairs else rm_dir(cfg) / "pairs.jsonl"


def sft_checkpoint(cfg: SlipstreamConfig) -> Path:
    return Path(cfg.run.output_dir) / "sft" / "checkpoint"


def init_reward_model(
    cfg: SlipstreamConfig,
    device: torch.device,
    dtype: torch.dtype,
    policy: str | Path | None = None,
) -> tuple[MoERewardModel, Tokenizer, str]:
    """(reward model, tokenizer, where it came from) per rm.init (see RMConfig.init); `policy`
    replaces the SFT checkpoint as the default."""
    from slipstream.model import MoEForCausalLM, load_pretrained

    start = Path(policy) if policy else sft_checkpoint(cfg)
    init = cfg.rm.init or (str(start) if start.is_dir() else "")
    if not init:
        tok = load_tokenizer(cfg.task.tokenizer)
        model_cfg = cfg.model.model_copy(deep=True)
        if model_cfg.vocab_size == 0:
            model_cfg.vocab_size = tok.vocab_size
        return MoERewardModel(model_cfg).to(device=device, dtype=dtype), tok, "random [model]"
    has_tok = (Path(init) / "tokenizer.json").is_file()
    tok = load_tokenizer(init if has_tok else cfg.task.tokenizer)
    if is_reward_checkpoint(init):
        rm = load_reward_model(init, device=device, dtype=dtype)
    else:
        policy: MoEForCausalLM = load_pretrained(init, device=device, dtype=dtype)
        rm = MoERewardModel.from_policy(policy)
    if rm.config.vocab_size < tok.vocab_size:
        raise ValueError(f"rm.init {init}: vocab_size {rm.config.vocab_size} < the tokenizer's "
                         f"{tok.vocab_size}")  # fmt: skip
    return rm, tok, init


def pairwise_accuracy(rm: MoERewardModel, tok: Tokenizer, pairs: list[Pair]) -> float:
    """Share of pairs with reward(chosen) > reward(rejected) (ties are wrong)."""
    if not pairs:
        return float("nan")
    was = rm.training
    rm.eval()
    try:
        seqs = [tok.encode_prompt(p.prompt + c) for p in pairs for c in (p.chosen, p.rejected)]
        r = score_ids(rm, seqs, tok.pad_id, max_batch=256)
    finally:
        rm.train(was)
    return sum(r[2 * i] > r[2 * i + 1] for i in range(len(pairs))) / len(pairs)


def split_pairs(
    pairs: list[Pair], heldout_fraction: float, seed: int
) -> tuple[list[Pair], list[Pair]]:
    """(train, held-out) after a seeded shuffle; at least one pair in each when there are two."""
    order = list(pairs)
    random.Random(f"rm-split/{seed}").shuffle(order)
    n_held = min(len(order) - 1, max(1, round(len(order) * heldout_fraction)))
    return order[: len(order) - n_held], order[len(order) - n_held :]


def train_reward_model(
    cfg: SlipstreamConfig, console: Console | None = None, policy: str | Path | None = None
) -> RMResult:
    """Train per [rm] and save the checkpoint (see the module docstring). `policy` (default: the
    SFT checkpoint) is what missing pairs are sampled from and what rm.init = "" starts from."""
    console = console or Console()
    device, dtype = setup_torch(cfg.run)
    path = pairs_path(cfg)
    if not path.is_file():
        if cfg.rm.pairs:
            raise FileNotFoundError(f"rm.pairs = {cfg.rm.pairs}: no such file")
        ckpt = Path(policy) if policy else sft_checkpoint(cfg)
        if not ckpt.is_dir():
            raise FileNotFoundError(f"{path}: no pairs, and no SFT checkpoint at {ckpt} to make "
                                    "them from (run `slipstream sft` first, or set rm.pairs)")  # fmt: skip
        stats = make_task_pairs(cfg, ckpt, path)
        console.print(f"[bold]rm pairs[/] {stats}")
    pairs = read_pairs(path)
    if len(pairs) < 2:
        raise PairsError(f"{path}: {len(pairs)} pair; rm train needs at least 2 (train + held-out)")
    train, held = split_pairs(pairs, cfg.rm.heldout_fraction, cfg.run.seed)
    torch.manual_seed(cfg.run.seed)
    rm, tok, origin = init_reward_model(cfg, device, dtype, policy)
    rc = cfg.rm
    acc0 = pairwise_accuracy(rm, tok, held)
    console.print(f"[bold]rm train[/] init={origin} pairs: {len(train)} train, {len(held)} held-out "
                  f"(accuracy before training {acc0:.3f}); steps={rc.steps} batch={rc.batch_size}")  # fmt: skip
    rm.train()
    optimizer = torch.optim.AdamW(rm.parameters(), lr=rc.lr, betas=(0.9, 0.95),
                                  weight_decay=rc.weight_decay)  # fmt: skip
    rng = random.Random(f"rm-batches/{cfg.run.seed}")
    order: list[int] = []
    start = time.perf_counter()
    final_loss, window_loss, window_acc, window_n = float("nan"), 0.0, 0.0, 0
    out_dir = rm_dir(cfg)
    with MetricsWriter(out_dir / "metrics.jsonl") as metrics:
        for step in range(rc.steps):
            if len(order) < rc.batch_size:
                fresh = list(range(len(train)))
                rng.shuffle(fresh)
                order += fresh
            batch, order = [train[i] for i in order[: rc.batch_size]], order[rc.batch_size :]
            seqs = [tok.encode_prompt(p.prompt + c) for p in batch for c in (p.chosen, p.rejected)]
            ids_BT, lengths_B = pad_batch(seqs, tok.pad_id)
            r_B, aux = rm.score_with_aux(ids_BT.to(device), lengths_B.to(device), skip_padding=True)
            margin = r_B[0::2] - r_B[1::2]
            loss = -F.logsigmoid(margin).mean()
            for group in optimizer.param_groups:
                group["lr"] = rc.lr * min(1.0, (step + 1) / max(1, rc.warmup_steps))
            optimizer.zero_grad(set_to_none=True)
            (loss + aux).backward()
            clip_grad_norm_(list(rm.parameters()), rc.grad_clip)
            optimizer.step()
            window_loss += loss.item()
            window_acc += (margin > 0).float().mean().item()
            window_n += 1
            if (step + 1) % rc.log_every == 0 or step + 1 == rc.steps:
                final_loss = window_loss / window_n
                metrics.log(step=step + 1, loss=final_loss, train_accuracy=window_acc / window_n,
                            elapsed_s=time.perf_counter() - start)  # fmt: skip
                console.print(f"rm step {step + 1}/{rc.steps} loss {final_loss:.4f} "
                              f"train acc {window_acc / window_n:.3f}")  # fmt: skip
                window_loss, window_acc, window_n = 0.0, 0.0, 0
        acc = pairwise_accuracy(rm, tok, held)
        metrics.log(step=rc.steps, heldout_accuracy=acc, heldout_pairs=len(held))
    result = RMResult(str(out_dir / "checkpoint"), rc.steps, len(train), len(held), acc0, acc,
                      final_loss, time.perf_counter() - start)  # fmt: skip
    save_reward_model(rm.eval(), out_dir / "checkpoint", tok, asdict(result))
    console.print(f"[bold]rm[/] held-out pairwise accuracy {acc:.3f} ({len(held)} pairs; "
                  f"{acc0:.3f} before training) -> {result.checkpoint_dir}")  # fmt: skip
    return result


def reward_model_complete(directory: str | Path) -> bool:
    """A finished `rm train` checkpoint (rm_summary.json is written last)."""
    return (Path(directory) / SUMMARY_FILE).is_file() and (
        Path(directory) / "config.json"
    ).is_file()


def ensure_reward_model(
    cfg: SlipstreamConfig, policy: str | Path, console: Console | None = None
) -> Path | None:
    """What `slipstream run` does before RL when [reward] needs a reward model scored in-process
    from <run.output_dir>/rm/checkpoint (reward.url and reward.model empty): train it (pairs from
    the SFT checkpoint, `train_reward_model`) unless a complete one is there. -> its directory,
    or None when the job needs no local reward model."""
    rc = cfg.reward
    if not rc.uses_reward_model() or rc.url or rc.model:
        return None
    ckpt = rm_dir(cfg) / "checkpoint"
    if not reward_model_complete(ckpt):
        train_reward_model(cfg, console, policy)
    return ckpt
