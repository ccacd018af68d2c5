"""Trainer: one optimizer step per batch of groups (GRPO or PPO), AdamW, grad clipping, LR
schedule, MoE aux loss, bf16/fp16 compute over float32 master weights (`trainer.precision`),
on one process or several ranks (slipstream.parallel).

Shape legend: B sequences (samples), T positions (prompt + completion - 1, right-padded),
V vocabulary, N groups, G samples per group.

Contract:
- `step(batch)` trains on this rank's share of the batch and returns float metrics. With
  several ranks every rank calls `step` with the same `Batch`; rank r takes groups r, r + W, ...
  Every loss term is normalised by the *whole batch's* counts (tokens or sequences summed over
  ranks) and gradients are summed over ranks (replicas: all-reduce; sharded: FSDP2), and the MoE
  router losses are the whole batch's (statistics summed over ranks): N ranks take the step one
  process takes on the batch, up to float summation order (tests/integration/test_rl_parallel.py).
  Logged metrics are over all ranks (loss terms and token counts summed, ratios averaged,
  rewards of the whole batch).
- Layouts (`trainer.parallel`): one process; whole-model replicas; FSDP2-sharded dense
  parameters with expert-parallel, FSDP2-sharded experts (parallel/sharding.py).
- `version` is `step_count`: weights after step k are policy version k.
- `full_state()` (collective when sharded) is the full HF-named state for publishing;
  `save` / `restore` checkpoint model, optimizer, scheduler, RNG and step (plus the critic for
  PPO) through a `CheckpointStore`: a torch file from rank 0, or, sharded, a DCP checkpoint
  every rank writes its shards of (loadable onto another layout).

Not covered: tensor/pipeline parallelism, gradient accumulation beyond minibatches, sequence
packing, PPO's critic and the KL reference model on a sharded layout (refused), global
normalisation of PPO's advantages over replicas (each rank normalises its share).
"""

from __future__ import annotations

import base64
import copy
import math
import random
from typing import Any

import numpy as np
import torch
from torch import nn

from slipstream.config import SlipstreamConfig
from slipstream.config.model import MoEImpl
from slipstream.config.rl import TrainerConfig
from slipstream.model.converters import apply_converters, model_converters
from slipstream.model.lm_loss import chunked_logprobs
from slipstream.parallel.ranks import Ranks
from slipstream.rewards.metrics import component_metrics
from slipstream.rl.advantages import gae, grpo_advantages
from slipstream.rl.losses import (
    aggregate,
    clipped_policy_loss,
    clipped_value_loss,
    count_for,
    entropy_from_logits,
    kl_k3,
    token_logprobs,
)
from slipstream.rl.routing import MismatchStats, collate_routing, mismatch_metrics
from slipstream.rl.types import Batch, Group, Sample
from slipstream.runtime import COMPUTE_DTYPES
from slipstream.storage import CheckpointStore


def collate(
    samples: list[Sample], pad_id: int, device: torch.device, pad_to: int | None = None
) -> dict[str, torch.Tensor]:
    """Right-padded tensors (to the longest sample, or `pad_to` positions); `mask_BT` marks
    target positions holding tokens the policy *sampled* (each sample's `loss_mask`: observation
    tokens a multi-turn environment appended are 0, so every loss term and the token mean ignore
    them), `behaviour_BT` their behaviour logprobs (0 elsewhere), `valid_BT` every real input
    position, `version_BT` the policy version that produced each input position's forward
    (prompt positions: the first sampled token's; an observation position: the version of the
    next sampled token, whose turn prefilled it; -1 on padding). When every sample carries
    recorded routing, `routing_BTLk` holds it (zeros on padding)."""
    T = max(len(s.prompt_ids) + len(s.completion_ids) for s in samples) - 1
    if pad_to is not None:
        if pad_to < T:
            raise ValueError(f"pad_to={pad_to} is shorter than the longest sample ({T})")
        T = pad_to
    B = len(samples)
    # Rows are built as Python lists and turned into one tensor per field: filling (B, T)
    # tensors slice by slice made ~8 torch calls per sample (5% of a quickstart RL step here).
    inputs, targets, mask, behaviour, versions, valid = [], [], [], [], [], []
    last = []
    for s in samples:
        seq = s.prompt_ids + s.completion_ids
        n, p = len(seq) - 1, len(s.prompt_ids)
        pad = T - n
        inputs.append(seq[:-1] + [pad_id] * pad)
        targets.append(seq[1:] + [pad_id] * pad)
        valid.append([True] * n + [False] * pad)
        last.append(max(n - 1, p - 1))
        # target j is token j + 1, so the completion's targets are positions p-1 .. n-1
        sampled = s.loss_mask if s.loss_mask else [1] * len(s.completion_ids)
        mask.append([False] * (p - 1) + [bool(m) for m in sampled] + [False] * pad)
        beh = [0.0] * T
        for j, lp in zip((p - 1 + i for i, m in enumerate(sampled) if m), s.behaviour_logprobs,
                         strict=True):  # fmt: skip
            beh[j] = lp
        behaviour.append(beh)
        if s.versions:
            per_token = (s.versions if all(sampled)
                         else _versions_per_token(list(sampled), s.versions))  # fmt: skip
            versions.append([s.versions[0]] * (p - 1) + per_token + [-1] * pad)
        else:
            versions.append([-1] * T)
    inputs_BT = torch.tensor(inputs, dtype=torch.long)
    targets_BT = torch.tensor(targets, dtype=torch.long)
    mask_BT = torch.tensor(mask, dtype=torch.bool)
    behaviour_BT = torch.tensor(behaviour, dtype=torch.float32)
    version_BT = torch.tensor(versions, dtype=torch.long)
    valid_BT = torch.tensor(valid, dtype=torch.bool)
    last_B = torch.tensor(last, dtype=torch.long)
    out = {"inputs_BT": inputs_BT, "targets_BT": targets_BT, "mask_BT": mask_BT,
           "behaviour_BT": behaviour_BT, "last_B": last_B, "version_BT": version_BT,
           "valid_BT": valid_BT}  # fmt: skip
    if all(s.routed_experts for s in samples):
        L, k = samples[0].routing_shape
        out["routing_BTLk"] = collate_routing(samples, T).view(L, B, T, k).permute(1, 2, 0, 3)
    return {k: v.to(device) for k, v in out.items()}


def _versions_per_token(loss_mask: list[int], versions: list[int]) -> list[int]:
    """One version per completion token: a sampled token's own; an observation token the version
    of the next sampled token (the turn whose prefill read it), or the last one if none follows."""
    out = [0] * len(loss_mask)
    sampled = iter(versions)
    for i, m in enumerate(loss_mask):
        out[i] = next(sampled) if m else -1
    following = versions[-1] if versions else -1
    for i in range(len(out) - 1, -1, -1):
        if loss_mask[i]:
            following = out[i]
        else:
            out[i] = following
    return out


def lr_factor(step: float, cfg: TrainerConfig) -> float:
    """Multiplier of cfg.lr at `step` (0-based, in batches; a fraction within a batch's
    minibatches): linear warm-up, then constant or cosine."""
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
    from slipstream.model.moe_block import SparseMoeBlock

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


def rng_state_json() -> dict[str, Any]:
    """rng_state() as JSON values (no pickle): the torch state as base64, python's and
    numpy's as lists."""
    np_state = np.random.get_state()
    state: dict[str, Any] = {
        "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(),
        "python": [random.getstate()[0], list(random.getstate()[1]), random.getstate()[2]],
        "numpy": [np_state[0], np_state[1].tolist(), *[float(x) for x in np_state[2:]]],
    }
    if torch.cuda.is_available():
        state["cuda"] = [base64.b64encode(s.numpy().tobytes()).decode()
                         for s in torch.cuda.get_rng_state_all()]  # fmt: skip
    return state


def rng_state_from_json(state: dict[str, Any]) -> dict[str, Any]:
    """The inverse of rng_state_json, as set_rng_state takes it."""

    def tensor(b64: str) -> torch.Tensor:
        return torch.frombuffer(bytearray(base64.b64decode(b64)), dtype=torch.uint8).clone()

    py = state["python"]
    npy = state["numpy"]
    out: dict[str, Any] = {
        "torch": tensor(state["torch"]),
        "python": (py[0], tuple(py[1]), py[2]),
        "numpy": (npy[0], np.array(npy[1], dtype=np.uint32), int(npy[2]), int(npy[3]), npy[4]),
    }
    if "cuda" in state:
        out["cuda"] = [tensor(s) for s in state["cuda"]]
    return out


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
        ranks: Ranks | None = None,
        moe_impl: MoEImpl = "grouped",
    ) -> None:
        """`ranks`: this process among the trainer ranks (default: one process). A sharded
        model (FSDP2, built by slipstream.parallel) needs ranks.sharded. `moe_impl`: the expert
        path (`model.moe_impl`), applied with the trainer's own model converters
        (model/converters.py: activation checkpointing, compile_blocks)."""
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
        self.ranks = ranks or Ranks(device=self.device)
        if self.ranks.sharded and (cfg.kl_coef > 0 or cfg.loss == "ppo"):
            raise ValueError(
                "trainer.parallel: a sharded layout (dp_shard x ep > 1) supports GRPO without a "
                "reference model; trainer.loss = 'ppo' and trainer.kl_coef > 0 need "
                "dp_shard = ep = 1"
            )
        if self.ranks.sharded and cfg.precision == "fp16":
            raise ValueError(
                "trainer.precision = 'fp16' needs an unsharded layout (dp_shard = ep = 1): its "
                "loss scaler checks gradients for overflow per rank, and sharded ranks hold "
                "different gradients (use precision = 'bf16', which needs no scaling)"
            )
        apply_converters(model, model_converters(moe_impl, cfg, self.device))
        if self.ranks.world > 1:  # router losses of the whole batch, not of this rank's share
            model.router_stats_sum = self.ranks.sum_keep_grad
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
        # fused: one kernel over all parameters (CPU and CUDA): 2.5x faster than the per-tensor
        # loop on the quickstart model here (4.6 vs 11.5 ms per step), equal within 3e-8
        self.optimizer = torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, cfg.adam_beta2),
                                           fused=self.device.type in ("cpu", "cuda"))  # fmt: skip
        # The schedule is in batches (trainer.steps, warmup_steps); the scheduler steps once per
        # optimizer step, num_minibatches of them per batch.
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: lr_factor(s / self.cfg.num_minibatches, self.cfg)
        )
        # fp16's 5 exponent bits: small gradients underflow unless the loss is scaled
        self.scaler = (torch.amp.GradScaler(self.device.type) if cfg.precision == "fp16"
                       else None)  # fmt: skip

    @property
    def version(self) -> int:
        """Policy version of the current weights: the number of steps taken (the starting
        checkpoint is version 0; a step that skips its optimizer update still counts)."""
        return self.step_count

    # ---- state ---------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Everything to resume (unsharded layouts; sharded ones checkpoint through `save`)."""
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

    def save(self, ckpts: CheckpointStore, coordinator_state: dict[str, Any] | None,
             meta: dict[str, Any]) -> None:  # fmt: skip
        """Checkpoint this step (every rank calls it; rank 0 passes the coordinator's state,
        the others None). Sharded: each rank writes its shards (DCP), rank 0 the rest and the
        manifest last. Unsharded: rank 0 writes one torch file."""
        step = self.step_count
        if self.ranks.sharded:
            from slipstream.parallel.checkpoint import save_sharded

            save_sharded(ckpts, step, self.model, self.optimizer, self._meta_json(),
                         coordinator_state, meta, rank=self.ranks.rank)  # fmt: skip
        elif self.ranks.rank == 0:
            assert coordinator_state is not None
            ckpts.save(step, self.state_dict(), coordinator_state, meta)

    def restore(self, ckpts: CheckpointStore, step: int) -> tuple[dict[str, Any], dict[str, Any]]:
        """Load checkpoint `step` (every rank calls it); -> (coordinator state, manifest)."""
        if self.ranks.sharded:
            from slipstream.parallel.checkpoint import load_sharded

            coord, manifest, extra = load_sharded(ckpts, step, self.model, self.optimizer)
            self.scheduler.load_state_dict(extra["scheduler"])
            set_rng_state(rng_state_from_json(extra["rng"]))
            self.step_count = extra["step"]
            return coord, manifest
        state, coord, manifest = ckpts.load(step)
        self.load_state_dict(state)
        return coord, manifest

    def _meta_json(self) -> dict[str, Any]:
        return {"scheduler": self.scheduler.state_dict(), "rng": rng_state_json(),
                "step": self.step_count}  # fmt: skip

    def full_state(self, copy: bool = True) -> dict[str, torch.Tensor] | None:
        """The policy's full internal state dict (every rank calls it; collective when sharded):
        on rank 0 copies the next step does not change, None on the others. `copy=False`
        (unsharded layouts): the live parameters, detached, for a caller that copies them
        before the next step (the publisher); sharded layouts always gather into copies."""
        if self.ranks.sharded:
            from slipstream.parallel.sharding import gather_full_state

            return gather_full_state(self.model, self.ranks.rank)
        if self.ranks.rank != 0:
            return None
        live = {k: v.detach() for k, v in self.model.state_dict().items()}
        return {k: v.clone() for k, v in live.items()} if copy else live

    # ---- step ----------------------------------------------------------------------------------

    def _autocast(self):
        dtype = COMPUTE_DTYPES[self.cfg.precision]
        return torch.autocast(self.device.type, dtype=dtype, enabled=dtype != torch.float32)

    def _logp(
        self, model: nn.Module, t: dict[str, torch.Tensor], num_real: int | None = None
    ) -> tuple[torch.Tensor, Any]:
        """Log-probabilities of the targets (and the model output). `num_real`: the real
        positions in t (host-side count; the packing then costs no host sync)."""
        logp_BT, _, out = self._logp_entropy(model, t, num_real, with_entropy=False)
        return logp_BT, out

    def _logp_entropy(
        self, model: nn.Module, t: dict[str, torch.Tensor], num_real: int | None,
        with_entropy: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None, Any]:  # fmt: skip
        """(log p(target) (B, T), entropy (B, T) or None, model output); 0 at padded positions
        when the forward skips padding. trainer.logits_chunk_tokens > 0: through the chunked
        LM head (model/lm_loss.py), else from the full float32 logits."""
        replay = None
        if self.cfg.routing_replay == "r3":  # route as the engine did for each position
            if "routing_BTLk" not in t:
                raise ValueError(
                    "trainer.routing_replay = 'r3' but the batch carries no recorded routing "
                    "(the engine must record it: rollout.record_routing, resolved on by r3)"
                )
            B, T, L, k = t["routing_BTLk"].shape
            replay = t["routing_BTLk"].permute(2, 0, 1, 3).reshape(L, B * T, k)
        # every per-token layer skips the padding unless the experts are sharded over ranks
        # (the expert-parallel dispatchers need one token count on every rank)
        skip = None if self.ranks.sharded else t["valid_BT"]
        chunk = self.cfg.logits_chunk_tokens
        with self._autocast():
            out = model(t["inputs_BT"], token_mask_BT=t["mask_BT"], replay_routing_LNk=replay,
                        skip_padding_BT=skip, num_real=num_real, return_hidden=chunk > 0)  # fmt: skip
            if chunk == 0:
                logits_BTV = out.logits_BTV / self.temperature
                ent = entropy_from_logits(logits_BTV) if with_entropy else None
                return token_logprobs(logits_BTV, t["targets_BT"]), ent, out
            targets_N = t["targets_BT"].reshape(-1)
            if out.rows_M is not None:
                targets_N = targets_N.index_select(0, out.rows_M)
            logp_N, ent_N = chunked_logprobs(
                out.hidden, model.lm_head.weight, targets_N, chunk_tokens=chunk,
                temperature=self.temperature, with_entropy=with_entropy,
            )  # fmt: skip
        B, T = t["targets_BT"].shape
        if out.rows_M is not None:  # back to (B, T), 0 at the padding
            logp_N = logp_N.new_zeros(B * T).index_copy(0, out.rows_M, logp_N)
            if ent_N is not None:
                ent_N = ent_N.new_zeros(B * T).index_copy(0, out.rows_M, ent_N)
        return logp_N.view(B, T), None if ent_N is None else ent_N.view(B, T), out

    def _advantages(
        self, groups: list[Group], t: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, dict]:
        """GRPO: per-token advantage = the sample's group-relative advantage. A group whose
        episodes gave several samples (`Sample.episode`: an agent that rewrote its history) is
        normalised over its episodes, and each episode's samples share its advantage."""
        if any(s.episode >= 0 for g in groups for s in g.samples):
            adv: list[float] = []
            for g in groups:
                keys = [s.episode if s.episode >= 0 else -1 - i for i, s in enumerate(g.samples)]
                reward_of = {}
                for k, s in zip(keys, g.samples, strict=True):
                    reward_of.setdefault(k, s.reward)
                r_1E = torch.tensor([list(reward_of.values())], dtype=torch.float32)
                a_E = grpo_advantages(r_1E, std_norm=self.cfg.std_norm)[0].tolist()
                adv_of = dict(zip(reward_of, a_E, strict=True))
                adv.extend(adv_of[k] for k in keys)
            adv_B = torch.tensor(adv, dtype=torch.float32, device=self.device)
            return adv_B[:, None].expand_as(t["behaviour_BT"]), {}
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
        return bool(self.ranks.max((adv_BT.abs().max() > 0).float().reshape(1)).item())

    def step(self, batch: Batch) -> dict[str, float]:
        """One batch: num_minibatches optimizer steps, then step_count (= version) += 1."""
        cfg = self.cfg
        self.model.train()
        groups = self.ranks.share(batch.groups)
        samples = [s for g in groups for s in g.samples]
        # One T on every rank: the same token count per rank keeps expert dispatch shapes equal
        # (the padded dispatcher's capacity); padding is masked out of every loss.
        pad_to = None
        if self.ranks.world > 1:
            local_T = max(len(s.prompt_ids) + len(s.completion_ids) for s in samples) - 1
            pad_to = int(self.ranks.max(torch.tensor(local_T, device=self.ranks.device)))
        t = collate(samples, self.pad_id, self.device, pad_to)
        # real positions per sample, known on the host (packing without a host sync)
        real_B = [len(s.prompt_ids) + len(s.completion_ids) - 1 for s in samples]
        extra: dict[str, torch.Tensor] = {}
        if cfg.loss == "grpo":
            extra["adv_BT"], _ = self._advantages(groups, t)
        else:
            extra["adv_BT"], extra["ret_BT"], extra["old_values_BT"] = self._ppo_targets(samples, t)
        old_logp_BT = None
        if cfg.num_minibatches > 1:
            with torch.no_grad():
                old_logp_BT, _ = self._logp(self.model, t, sum(real_B))
        ref_logp_BT = None
        if self.ref_model is not None:
            with torch.no_grad():
                ref_logp_BT, _ = self._logp(self.ref_model, t, sum(real_B))
        B = len(samples)
        mb = max(1, math.ceil(B / cfg.num_minibatches))
        num_mb = math.ceil(B / mb)
        totals: dict[str, float] = {"skipped": 0.0}
        if cfg.loss == "grpo" and cfg.skip_no_signal and not self._has_signal(extra["adv_BT"]):
            # No optimizer step (the LR schedule counts the steps taken); loss is undefined.
            totals.update(skipped=1.0, pg_loss=float("nan"))
        for i in range(0, B, mb) if not totals["skipped"] else ():
            sl = slice(i, i + mb)
            part = {k: v[sl] for k, v in t.items()}
            stats = self._minibatch(part, {k: v[sl] for k, v in extra.items()},
                                    None if old_logp_BT is None else old_logp_BT[sl],
                                    None if ref_logp_BT is None else ref_logp_BT[sl],
                                    sum(real_B[sl]))  # fmt: skip
            for k, v in stats.items():
                totals[k] = totals.get(k, 0.0) + v / num_mb
        self.step_count += 1
        totals.update(
            lr=self.scheduler.get_last_lr()[0],
            num_tokens=float(t["mask_BT"].sum()),
            completion_len_mean=float(t["mask_BT"].sum(-1).float().mean()),
        )
        sums = [k for k in totals if k.endswith(MISMATCH_SUMS)]
        totals = self.ranks.reduce_metrics(totals, summed=(*SUMMED_METRICS, *sums))
        totals.update(mismatch_metrics({k: totals.pop(k) for k in sums}))
        totals["loss"] = self._total_loss(totals)
        # over the whole batch (every rank holds it), not this rank's share
        totals.update(
            reward_mean=float(np.mean([s.reward for s in batch.samples])),
            num_samples=float(len(batch.samples)),
            routing_bytes_per_sample=float(np.mean([len(s.routed_experts) for s in batch.samples])),
            tool_calls_per_sample=float(np.mean([s.tool_calls for s in batch.samples])),
            **component_metrics(batch.samples),
        )
        return totals

    def _total_loss(self, m: dict[str, float]) -> float:
        """The optimised loss from its (rank-summed) terms; nan for a skipped step."""
        cfg = self.cfg
        if m["skipped"]:
            return float("nan")
        return (m["pg_loss"] + m["aux_loss"] - cfg.entropy_coef * m.get("entropy", 0.0)
                + cfg.kl_coef * m.get("kl", 0.0) + cfg.value_coef * m.get("value_loss", 0.0))  # fmt: skip

    def _mismatch(
        self, t: dict[str, torch.Tensor], logp_BT: torch.Tensor, out: Any
    ) -> dict[str, float]:
        """Train-inference mismatch sums of a minibatch (rl/routing.py): the proximal logp
        against the behaviour logp, and (with recorded routing) the live router's top-k against
        the engine's, by staleness."""
        mis = MismatchStats()
        stale_BT = self.version - t["version_BT"]
        mis.add_logprobs(logp_BT.detach(), t["behaviour_BT"], t["mask_BT"], stale_BT)
        if "routing_BTLk" in t and out.router_logits is not None:
            B, T, L, k = t["routing_BTLk"].shape
            recorded_LNk = t["routing_BTLk"].permute(2, 0, 1, 3).reshape(L, B * T, k)
            mis.add_routing(out.router_logits, recorded_LNk, t["valid_BT"].reshape(-1),
                            stale_BT.reshape(-1),
                            self.model.select_experts(out.router_logits))  # fmt: skip
        return mis.sums

    def _minibatch(self, t, extra, old_logp_BT, ref_logp_BT, num_real=None) -> dict[str, float]:
        """One optimizer step on a minibatch (this rank's slice of it). Loss terms are divided
        by the minibatch's counts over all ranks, so the ranks' losses add up to the whole
        minibatch's loss and its gradient is the sum of theirs."""
        cfg = self.cfg
        stats_t, logp_BT, out = self._forward_backward(t, extra, old_logp_BT, ref_logp_BT,
                                                       num_real)  # fmt: skip
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        self.ranks.after_backward(params)
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        grad_norm = self.ranks.clip_grad_norm_(params, cfg.grad_clip)
        if self.scaler is None:
            self.optimizer.step()
        else:  # skips the update when a gradient overflowed, and lowers the scale
            scale = self.scaler.get_scale()
            self.scaler.step(self.optimizer)
            self.scaler.update()
            stats_t["grad_scale_skipped"] = torch.tensor(float(self.scaler.get_scale() < scale))
        self.scheduler.step()
        # the minibatch's metrics reach the host here, in one read, after its kernels are queued
        names = list(stats_t)
        values = torch.stack([stats_t[k].float() for k in names]).tolist() if names else []
        stats = dict(zip(names, values, strict=True))
        stats["grad_norm"] = grad_norm
        old = logp_BT.detach() if old_logp_BT is None else old_logp_BT
        stats.update(self._mismatch(t, old, out))
        return stats

    def _forward_backward(self, t, extra, old_logp_BT, ref_logp_BT, num_real=None):
        """The minibatch's forward, loss and backward, with no host sync (the op-count test,
        tests/unit/test_trainer_ops.py, counts this): -> (loss terms and stats as detached 0-d
        tensors, logp_BT, model output)."""
        cfg = self.cfg
        mask_BT = t["mask_BT"]
        denom = self.ranks.sum(count_for(mask_BT, cfg.aggregation))
        logp_BT, ent_BT, out = self._logp_entropy(self.model, t, num_real,
                                                  with_entropy=cfg.entropy_coef > 0)  # fmt: skip
        old = logp_BT.detach() if old_logp_BT is None else old_logp_BT
        pg_loss, stats = clipped_policy_loss(
            logp_BT, old, extra["adv_BT"], mask_BT, clip_low=cfg.clip_low, clip_high=cfg.clip_high,
            behaviour_logp_BT=t["behaviour_BT"], is_cap=cfg.is_cap, aggregation=cfg.aggregation,
            denom=denom,
        )  # fmt: skip
        loss = pg_loss + out.aux_loss
        stats["pg_loss"] = pg_loss.detach()
        stats["aux_loss"] = out.aux_loss.detach()
        if cfg.entropy_coef > 0:
            ent = aggregate(ent_BT, mask_BT, cfg.aggregation, denom)
            loss = loss - cfg.entropy_coef * ent
            stats["entropy"] = ent.detach()
        if ref_logp_BT is not None:
            kl = aggregate(kl_k3(logp_BT, ref_logp_BT), mask_BT, cfg.aggregation, denom)
            loss = loss + cfg.kl_coef * kl
            stats["kl"] = kl.detach()
        if self.critic is not None:
            with self._autocast():
                values_BT = self.critic(t["inputs_BT"]).logits_BTV[..., 0].float()
            v_loss = clipped_value_loss(values_BT, extra["old_values_BT"], extra["ret_BT"], mask_BT,
                                        clip=cfg.value_clip, aggregation=cfg.aggregation,
                                        denom=denom)  # fmt: skip
            loss = loss + cfg.value_coef * v_loss
            stats["value_loss"] = v_loss.detach()
        self.optimizer.zero_grad(set_to_none=True)
        (loss if self.scaler is None else self.scaler.scale(loss)).backward()
        return stats, logp_BT, out


SUMMED_METRICS = ("pg_loss", "entropy", "kl", "value_loss", "num_tokens")
"""Metrics that are each rank's part of the whole batch's value (added over ranks)."""
MISMATCH_SUMS = tuple(f"_s{b}" for b in ("0", "1", "2+"))
"""Suffixes of the mismatch sums (rl/routing.py), added over ranks before the means."""


def build_trainer(
    cfg: SlipstreamConfig, init_checkpoint: str, device: torch.device, pad_id: int
) -> Trainer:
    """The policy loaded from the start checkpoint, in train mode, and its Trainer, laid out per
    [trainer.parallel]. Every trainer rank builds it with this function (same seed first, after
    init_process_group; collective when sharded), so all start from the same state."""
    torch.manual_seed(cfg.run.seed)
    dtype = getattr(torch, cfg.run.dtype)
    layout = cfg.trainer.parallel
    if layout.sharded:
        from slipstream.parallel import build_parallel_model

        model, ranks = build_parallel_model(cfg.trainer, init_checkpoint, device, dtype)
    else:
        from slipstream.model import load_pretrained

        model = load_pretrained(init_checkpoint, device=device, dtype=dtype)
        ranks = Ranks.current(sharded=False, device=device)
    model.train()
    return Trainer(model, cfg.trainer, pad_id=pad_id, device=device,
                   temperature=cfg.rollout.temperature or 1.0, ranks=ranks,
                   moe_impl=cfg.model.moe_impl)  # fmt: skip
