"""Trainer: one optimizer step per batch of groups (GRPO or PPO), AdamW, grad clipping, LR
schedule, MoE aux loss, bf16 autocast, data parallel over torch.distributed.

Shape legend: B sequences (samples), T positions (prompt + completion - 1, right-padded),
V vocabulary, N groups, G samples per group.

Contract:
- `step(batch)` trains on this rank's share of the batch and returns float metrics. Under data
  parallelism every rank calls `step` with the same `Batch`; rank r takes groups r, r + W, ...
  Gradients are averaged over ranks with all_reduce (missing grads of unused experts count as
  zeros), so each rank's loss is its local mean and the update equals the single-process update
  when ranks hold equal shares under `seq_mean` (token_mean weighs ranks equally, not tokens)
  and the MoE load-balancing loss is off: it is computed on each rank's share (as Megatron
  balances per micro-batch), so with `router_aux_loss_coef` > 0 the DP update differs slightly.
  Logged metrics are over all ranks (losses averaged, token counts summed, rewards of the batch).
- `version` is `step_count`: weights after step k are policy version k.
- `state_dict()` / `load_state_dict()` carry model, optimizer, scheduler, RNG and step
  (plus the critic for PPO): enough to resume a run bit-for-bit on the same machine.

Not covered: tensor/expert/pipeline parallelism, gradient accumulation beyond minibatches,
sequence packing.
"""

from __future__ import annotations

import copy
import math
import random
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from slipstream.config import SlipstreamConfig
from slipstream.config.rl import TrainerConfig
from slipstream.rl.advantages import gae, grpo_advantages
from slipstream.rl.losses import (
    aggregate,
    clipped_policy_loss,
    clipped_value_loss,
    entropy_from_logits,
    kl_k3,
    token_logprobs,
)
from slipstream.rl.types import Batch, Group, Sample


def collate(samples: list[Sample], pad_id: int, device: torch.device) -> dict[str, torch.Tensor]:
    """Right-padded tensors; `mask_BT` marks target positions holding completion tokens."""
    T = max(len(s.prompt_ids) + len(s.completion_ids) for s in samples) - 1
    B = len(samples)
    inputs_BT = torch.full((B, T), pad_id, dtype=torch.long)
    targets_BT = torch.full((B, T), pad_id, dtype=torch.long)
    mask_BT = torch.zeros((B, T), dtype=torch.bool)
    behaviour_BT = torch.zeros((B, T), dtype=torch.float32)
    last_B = torch.zeros(B, dtype=torch.long)
    for b, s in enumerate(samples):
        seq = s.prompt_ids + s.completion_ids
        n, p = len(seq) - 1, len(s.prompt_ids)
        inputs_BT[b, :n] = torch.tensor(seq[:-1])
        targets_BT[b, :n] = torch.tensor(seq[1:])
        # target j is token j + 1, so the completion's targets are positions p-1 .. n-1
        mask_BT[b, p - 1 : n] = True
        behaviour_BT[b, p - 1 : n] = torch.tensor(s.behaviour_logprobs, dtype=torch.float32)
        last_B[b] = max(n - 1, p - 1)
    out = {"inputs_BT": inputs_BT, "targets_BT": targets_BT, "mask_BT": mask_BT,
           "behaviour_BT": behaviour_BT, "last_B": last_B}  # fmt: skip
    return {k: v.to(device) for k, v in out.items()}


def lr_factor(step: int, cfg: TrainerConfig) -> float:
    """Multiplier of cfg.lr at `step` (0-based): linear warm-up, then constant or cosine."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.lr_schedule == "constant":
        return 1.0
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps))
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def make_critic(policy: nn.Module) -> nn.Module:
    """PPO critic: a copy of the policy whose LM head is a zero-initialised Linear(D, 1), so its
    `logits_BTV[..., 0]` is a per-position value."""
    critic = copy.deepcopy(policy)
    hidden = critic.lm_head.in_features
    critic.lm_head = nn.Linear(hidden, 1, bias=True).to(next(policy.parameters()).device)
    nn.init.zeros_(critic.lm_head.weight)
    nn.init.zeros_(critic.lm_head.bias)
    return critic


def freeze_routers(model: nn.Module) -> list[str]:
    """Stop training the MoE routers (`SparseMoeBlock.gate`); returns the frozen parameter names.

    Why: Adam gives every parameter a step of about lr whatever its gradient, and a router weight
    that moves flips tokens' top-k expert choice, a discontinuous change of the function. Under the
    small, noisy RL gradients this routing drift degraded held-out accuracy at lr >= 1e-4 on the
    quickstart model (docs/rl.md); experts, attention and embeddings still train."""
    from slipstream.model.moe import SparseMoeBlock

    names = []
    for mod_name, mod in model.named_modules():
        if isinstance(mod, SparseMoeBlock):
            for p_name, p in mod.gate.named_parameters():
                p.requires_grad_(False)
                names.append(f"{mod_name}.gate.{p_name}")
    if not names:
        raise ValueError(
            "trainer.freeze_router is set but the model has no MoE router (SparseMoeBlock)"
        )
    return names


def rng_state() -> dict[str, Any]:
    state = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": np.random.get_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class Trainer:
    def __init__(
        self,
        model: nn.Module,
        cfg: TrainerConfig,
        *,
        pad_id: int,
        device: torch.device | str = "cpu",
        temperature: float = 1.0,
    ) -> None:
        if temperature <= 0:
            raise ValueError(
                f"trainer temperature must be > 0 (rollout.temperature), got {temperature}"
            )
        self.model = model
        self.cfg = cfg
        self.pad_id = pad_id
        # The policy being optimised is the sampling policy: logits / rollout temperature, so the
        # trainer's log-probabilities are comparable with the engine's behaviour log-probabilities.
        self.temperature = temperature
        self.device = torch.device(device)
        self.step_count = 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.ref_model = None
        if cfg.kl_coef > 0:
            self.ref_model = copy.deepcopy(model).eval().requires_grad_(False)
        self.critic = make_critic(model) if cfg.loss == "ppo" else None
        self.frozen = freeze_routers(model) if cfg.freeze_router else []
        trainable = [p for p in model.parameters() if p.requires_grad]
        decay = [p for p in trainable if p.ndim >= 2]
        no_decay = [p for p in trainable if p.ndim < 2]
        groups = [
            {"params": decay, "weight_decay": cfg.weight_decay, "lr": cfg.lr},
            {"params": no_decay, "weight_decay": 0.0, "lr": cfg.lr},
        ]
        if self.critic is not None:
            groups.append({"params": list(self.critic.parameters()), "weight_decay": 0.0,
                           "lr": cfg.value_lr or cfg.lr})  # fmt: skip
        self.optimizer = torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, cfg.adam_beta2))
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: lr_factor(s, self.cfg)
        )

    @property
    def version(self) -> int:
        """Policy version of the current weights: the number of steps taken (the starting
        checkpoint is version 0; a step that skips its optimizer update still counts)."""
        return self.step_count

    # ---- state ---------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        state = {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "rng": rng_state(),
            "step": self.step_count,
        }
        if self.critic is not None:
            state["critic"] = self.critic.state_dict()
        if self.ref_model is not None:
            state["ref_model"] = self.ref_model.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        if self.critic is not None:
            self.critic.load_state_dict(state["critic"])
        if self.ref_model is not None:
            self.ref_model.load_state_dict(state["ref_model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        set_rng_state(state["rng"])
        self.step_count = state["step"]

    # ---- step ----------------------------------------------------------------------------------

    def _shard(self, groups: list[Group]) -> list[Group]:
        if self.world == 1:
            return groups
        if len(groups) % self.world:
            raise ValueError(f"{len(groups)} groups do not split evenly over {self.world} ranks")
        return groups[self.rank :: self.world]

    def _autocast(self):
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.cfg.bf16)

    def _logp(self, model: nn.Module, t: dict[str, torch.Tensor]) -> tuple[torch.Tensor, Any]:
        with self._autocast():
            out = model(t["inputs_BT"], token_mask_BT=t["mask_BT"])
        return token_logprobs(out.logits_BTV / self.temperature, t["targets_BT"]), out

    def _advantages(
        self, groups: list[Group], t: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, dict]:
        """GRPO: per-token advantage = the sample's group-relative advantage."""
        sizes = {len(g.samples) for g in groups}
        if len(sizes) != 1:
            raise ValueError(f"groups of unequal sizes {sorted(sizes)} in one batch")
        rewards_NG = torch.tensor([g.rewards for g in groups], dtype=torch.float32)
        adv_B = grpo_advantages(rewards_NG, std_norm=self.cfg.std_norm).reshape(-1).to(self.device)
        return adv_B[:, None].expand_as(t["behaviour_BT"]), {}

    def _ppo_targets(self, samples: list[Sample], t: dict[str, torch.Tensor]):
        with torch.no_grad(), self._autocast():
            values_BT = self.critic(t["inputs_BT"]).logits_BTV[..., 0].float()
        rewards_BT = torch.zeros_like(values_BT)
        r_B = torch.tensor([s.reward for s in samples], dtype=torch.float32, device=self.device)
        rewards_BT.scatter_(1, t["last_B"][:, None], r_B[:, None])
        adv_BT, ret_BT = gae(rewards_BT, values_BT, t["mask_BT"], gamma=self.cfg.ppo_gamma,
                             lam=self.cfg.ppo_lambda)  # fmt: skip
        m = t["mask_BT"].float()
        mean = (adv_BT * m).sum() / m.sum().clamp(min=1)
        std = (((adv_BT - mean) ** 2 * m).sum() / m.sum().clamp(min=1)).sqrt()
        return (adv_BT - mean) / (std + 1e-6) * m, ret_BT, values_BT

    def _has_signal(self, adv_BT: torch.Tensor) -> bool:
        """Any non-zero advantage on any rank (all ranks must agree to skip a step)."""
        flag = (adv_BT.abs().max() > 0).float().reshape(1)
        if self.world > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def step(self, batch: Batch) -> dict[str, float]:
        """One batch: num_minibatches optimizer steps, then step_count (= version) += 1."""
        cfg = self.cfg
        self.model.train()
        groups = self._shard(batch.groups)
        samples = [s for g in groups for s in g.samples]
        t = collate(samples, self.pad_id, self.device)
        extra: dict[str, torch.Tensor] = {}
        if cfg.loss == "grpo":
            extra["adv_BT"], _ = self._advantages(groups, t)
        else:
            extra["adv_BT"], extra["ret_BT"], extra["old_values_BT"] = self._ppo_targets(samples, t)
        old_logp_BT = None
        if cfg.num_minibatches > 1:
            with torch.no_grad():
                old_logp_BT, _ = self._logp(self.model, t)
        ref_logp_BT = None
        if self.ref_model is not None:
            with torch.no_grad():
                ref_logp_BT, _ = self._logp(self.ref_model, t)
        B = len(samples)
        mb = max(1, math.ceil(B / cfg.num_minibatches))
        totals: dict[str, float] = {"skipped": 0.0}
        if cfg.loss == "grpo" and cfg.skip_no_signal and not self._has_signal(extra["adv_BT"]):
            # No optimizer step (the LR schedule counts the steps taken); loss is undefined.
            totals.update(skipped=1.0, loss=float("nan"), pg_loss=float("nan"))
        for i in range(0, B, mb) if not totals["skipped"] else ():
            sl = slice(i, i + mb)
            part = {k: v[sl] for k, v in t.items()}
            stats = self._minibatch(part, {k: v[sl] for k, v in extra.items()},
                                    None if old_logp_BT is None else old_logp_BT[sl],
                                    None if ref_logp_BT is None else ref_logp_BT[sl])  # fmt: skip
            for k, v in stats.items():
                totals[k] = totals.get(k, 0.0) + v / math.ceil(B / mb)
        self.step_count += 1
        totals.update(
            lr=self.scheduler.get_last_lr()[0],
            num_tokens=float(t["mask_BT"].sum()),
            completion_len_mean=float(t["mask_BT"].sum(-1).float().mean()),
        )
        if self.world > 1:
            totals = self._reduce_metrics(totals)
        # over the whole batch (every rank holds it), not this rank's share
        totals.update(
            reward_mean=float(np.mean([s.reward for s in batch.samples])),
            num_samples=float(len(batch.samples)),
        )
        return totals

    def _reduce_metrics(self, totals: dict[str, float]) -> dict[str, float]:
        """Metrics over all ranks: token counts summed, `*_max` maxed, the rest averaged (equal
        shares). Every rank has the same keys: they take the same code path."""
        keys = sorted(totals)
        summed = [k for k in keys if k == "num_tokens"]
        maxed = [k for k in keys if k.endswith("_max")]
        meaned = [k for k in keys if k not in summed and k not in maxed]
        out = dict(totals)
        for names, op in ((summed, dist.ReduceOp.SUM), (maxed, dist.ReduceOp.MAX),
                          (meaned, dist.ReduceOp.SUM)):  # fmt: skip
            if not names:
                continue
            v = torch.tensor([totals[k] for k in names], dtype=torch.float64, device=self.device)
            dist.all_reduce(v, op=op)
            for k, x in zip(names, v.tolist(), strict=True):
                out[k] = x / self.world if names is meaned else x
        return out

    def _minibatch(self, t, extra, old_logp_BT, ref_logp_BT) -> dict[str, float]:
        cfg = self.cfg
        logp_BT, out = self._logp(self.model, t)
        old = logp_BT.detach() if old_logp_BT is None else old_logp_BT
        mask_BT = t["mask_BT"]
        pg_loss, stats = clipped_policy_loss(
            logp_BT, old, extra["adv_BT"], mask_BT, clip_low=cfg.clip_low, clip_high=cfg.clip_high,
            behaviour_logp_BT=t["behaviour_BT"], is_cap=cfg.is_cap, aggregation=cfg.aggregation,
        )  # fmt: skip
        loss = pg_loss + out.aux_loss
        stats["pg_loss"] = float(pg_loss.detach())
        stats["aux_loss"] = float(out.aux_loss.detach())
        if cfg.entropy_coef > 0:
            ent = aggregate(
                entropy_from_logits(out.logits_BTV / self.temperature), mask_BT, cfg.aggregation
            )
            loss = loss - cfg.entropy_coef * ent
            stats["entropy"] = float(ent.detach())
        if ref_logp_BT is not None:
            kl = aggregate(kl_k3(logp_BT, ref_logp_BT), mask_BT, cfg.aggregation)
            loss = loss + cfg.kl_coef * kl
            stats["kl"] = float(kl.detach())
        if self.critic is not None:
            with self._autocast():
                values_BT = self.critic(t["inputs_BT"]).logits_BTV[..., 0].float()
            v_loss = clipped_value_loss(values_BT, extra["old_values_BT"], extra["ret_BT"], mask_BT,
                                        clip=cfg.value_clip, aggregation=cfg.aggregation)  # fmt: skip
            loss = loss + cfg.value_coef * v_loss
            stats["value_loss"] = float(v_loss.detach())
        stats["loss"] = float(loss.detach())
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        if self.world > 1:
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                dist.all_reduce(p.grad)
                p.grad.div_(self.world)
        stats["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip))
        self.optimizer.step()
        self.scheduler.step()
        return stats


def build_trainer(
    cfg: SlipstreamConfig, init_checkpoint: str, device: torch.device, pad_id: int
) -> Trainer:
    """The policy loaded from the start checkpoint, in train mode, and its Trainer. Every trainer
    rank builds it with this function (same seed first), so all start from the same state."""
    from slipstream.model import load_pretrained

    torch.manual_seed(cfg.run.seed)
    model = load_pretrained(init_checkpoint, device=device, dtype=getattr(torch, cfg.run.dtype))
    model.train()
    return Trainer(model, cfg.trainer, pad_id=pad_id, device=device,
                   temperature=cfg.rollout.temperature or 1.0)  # fmt: skip
