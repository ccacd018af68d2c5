"""Policy-gradient losses: clipped surrogate with separate low/high clip (DAPO clip-higher),
truncated importance sampling against the behaviour policy, k3 KL to a reference, entropy bonus,
clipped value loss. Pure functions of tensors; the trainer wires them up.

Shape legend: B sequences, T completion tokens, V vocabulary.

Three policies appear (decoupled PPO, as in AReaL):
- behaviour: the engine's weights that sampled the tokens (`behaviour_logprobs` of each Sample);
- proximal (`old_logp`): the trainer's weights before this step's update;
- current (`logp`): the weights being optimised.
The clipped ratio is current/proximal; the truncated IS weight min(proximal/behaviour, cap)
corrects for stale or mismatched behaviour weights (cap <= 0 disables it).
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

Aggregation = Literal["token_mean", "seq_mean"]


def token_logprobs(logits_BTV: torch.Tensor, targets_BT: torch.Tensor) -> torch.Tensor:
    """log p(target_t) under logits_t (float32)."""
    logp_BTV = F.log_softmax(logits_BTV.float(), dim=-1)
    return logp_BTV.gather(-1, targets_BT.unsqueeze(-1)).squeeze(-1)


def entropy_from_logits(logits_BTV: torch.Tensor) -> torch.Tensor:
    logp_BTV = F.log_softmax(logits_BTV.float(), dim=-1)
    return -(logp_BTV.exp() * logp_BTV).sum(-1)


def aggregate(
    x_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    mode: Aggregation,
    denom: torch.Tensor | None = None,
) -> torch.Tensor:
    """token_mean: sum over all valid tokens / their count (long answers weigh more, DAPO);
    seq_mean: mean over sequences of each sequence's token mean (GRPO's original form).
    Sequences with no valid token contribute nothing.

    `denom` (data-parallel training): the count to divide by instead of this batch's own, i.e.
    the valid tokens (token_mean) or non-empty sequences (seq_mean) of the whole batch over all
    ranks (`count_for`), so the ranks' results add up to the whole batch's value."""
    m_BT = mask_BT.to(x_BT.dtype)
    if mode not in ("token_mean", "seq_mean"):
        raise ValueError(f"unknown aggregation {mode!r} (token_mean or seq_mean)")
    if denom is None:
        denom = count_for(mask_BT, mode)
    if mode == "token_mean":
        return (x_BT * m_BT).sum() / denom.clamp(min=1.0)
    n_B = m_BT.sum(-1)
    per_seq_B = (x_BT * m_BT).sum(-1) / n_B.clamp(min=1.0)
    return per_seq_B.sum() / denom.clamp(min=1)


def count_for(mask_BT: torch.Tensor, mode: Aggregation) -> torch.Tensor:
    """What `aggregate` divides by: valid tokens (token_mean) or non-empty sequences."""
    m_BT = mask_BT.float()
    if mode == "token_mean":
        return m_BT.sum()
    return (m_BT.sum(-1) > 0).sum().float()


def truncated_is_weights(
    old_logp_BT: torch.Tensor, behaviour_logp_BT: torch.Tensor, cap: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(min(exp(old - behaviour), cap) detached, raw ratio). cap <= 0 gives weights of 1."""
    raw_BT = torch.exp((old_logp_BT - behaviour_logp_BT).detach())
    if cap <= 0:
        return torch.ones_like(raw_BT), raw_BT
    return raw_BT.clamp(max=cap), raw_BT


def kl_k3(logp_BT: torch.Tensor, ref_logp_BT: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(current || reference): exp(d) - d - 1 with d = ref - current.
    Non-negative, unbiased for samples from the current policy."""
    d_BT = ref_logp_BT - logp_BT
    return torch.exp(d_BT) - d_BT - 1.0


def clipped_policy_loss(
    logp_BT: torch.Tensor,
    old_logp_BT: torch.Tensor,
    advantages_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    behaviour_logp_BT: torch.Tensor | None = None,
    is_cap: float = 2.0,
    aggregation: Aggregation = "token_mean",
    denom: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """-w * min(r A, clip(r, 1 - clip_low, 1 + clip_high) A), aggregated; r = exp(logp - old).

    Stats (detached 0-d tensors, so the step reads them on the host once, after its backward):
    clip_frac (valid tokens where the clipped branch is the active one), ratio_mean,
    is_ratio_mean and is_ratio_max (raw proximal/behaviour ratio), is_truncated_frac (tokens
    whose weight hit cap)."""
    ratio_BT = torch.exp(logp_BT - old_logp_BT.detach())
    clipped_BT = ratio_BT.clamp(1.0 - clip_low, 1.0 + clip_high)
    surr_BT = torch.maximum(-advantages_BT * ratio_BT, -advantages_BT * clipped_BT)
    m_BT = mask_BT.to(logp_BT.dtype)
    n_tok = m_BT.sum().clamp(min=1.0)
    stats: dict[str, torch.Tensor] = {}
    if behaviour_logp_BT is not None:
        w_BT, raw_BT = truncated_is_weights(old_logp_BT, behaviour_logp_BT, is_cap)
        surr_BT = w_BT * surr_BT  # the weight is detached; the surrogate keeps its gradient
    with torch.no_grad():
        if behaviour_logp_BT is not None:
            stats["is_ratio_mean"] = (raw_BT * m_BT).sum() / n_tok
            # 1 when no token is valid (a where, not a Python branch on a device value)
            stats["is_ratio_max"] = torch.where(
                m_BT.sum() > 0, (raw_BT * m_BT).max(), torch.ones_like(n_tok)
            )
            if is_cap > 0:
                stats["is_truncated_frac"] = ((raw_BT > is_cap) * m_BT).sum() / n_tok
            else:
                stats["is_truncated_frac"] = torch.zeros_like(n_tok)
        active_clip_BT = -advantages_BT * clipped_BT > -advantages_BT * ratio_BT
        stats["clip_frac"] = (active_clip_BT * m_BT).sum() / n_tok
        stats["ratio_mean"] = (ratio_BT * m_BT).sum() / n_tok
    return aggregate(surr_BT, mask_BT, aggregation, denom), stats


def clipped_value_loss(
    values_BT: torch.Tensor,
    old_values_BT: torch.Tensor,
    returns_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    *,
    clip: float = 0.2,
    aggregation: Aggregation = "token_mean",
    denom: torch.Tensor | None = None,
) -> torch.Tensor:
    """0.5 * max((V - R)^2, (clip(V, V_old +- clip) - R)^2), aggregated (PPO's value loss)."""
    v_clipped_BT = old_values_BT + (values_BT - old_values_BT).clamp(-clip, clip)
    loss_BT = 0.5 * torch.maximum((values_BT - returns_BT) ** 2, (v_clipped_BT - returns_BT) ** 2)
    return aggregate(loss_BT, mask_BT, aggregation, denom)
