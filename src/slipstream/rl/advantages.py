"""Advantage estimators: GRPO's group-relative advantages and PPO's GAE.

Shape legend: N groups, G samples per group, B sequences, T completion tokens.
"""

from __future__ import annotations

import torch


def grpo_advantages(
    rewards_NG: torch.Tensor, *, std_norm: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """(r - mean_group(r)) / (std_group(r) + eps) when std_norm, else r - mean_group(r).

    The std is the population std (divide by G), so a group of two rewards {0, 1} gets advantages
    {-1, +1} (up to eps). A group whose rewards are all equal gets advantages 0 either way."""
    if rewards_NG.dim() != 2:
        raise ValueError(
            f"rewards must be [N groups, G samples], got shape {tuple(rewards_NG.shape)}"
        )
    centred_NG = rewards_NG - rewards_NG.mean(dim=1, keepdim=True)
    if not std_norm:
        return centred_NG
    std_N1 = rewards_NG.std(dim=1, keepdim=True, unbiased=False)
    return centred_NG / (std_N1 + eps)


def gae(
    rewards_BT: torch.Tensor,
    values_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    *,
    gamma: float = 1.0,
    lam: float = 0.95,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over right-padded sequences whose steps are the
    positions where `mask_BT` is set.

    Over the masked positions t < t' (t' the next masked position after t):
    delta_t = r_t + gamma * V_t' - V_t;  A_t = delta_t + gamma * lam * A_t'. Value after the
    last masked position is 0 (the episode ends with it). Unmasked positions are not steps and
    are skipped, not terminal: padding and the prompt (outside the completion) change nothing,
    and the observation tokens of a multi-turn episode (inside it) are passed over, so an earlier
    turn's tokens still see the reward at the episode's end. Returns (advantages_BT, returns_BT =
    advantages + values), both zero where the mask is not set."""
    m_BT = mask_BT.to(values_BT.dtype)
    values_BT = values_BT.detach() * m_BT
    B, T = rewards_BT.shape
    adv_BT = torch.zeros_like(values_BT)
    next_adv_B = torch.zeros(B, dtype=values_BT.dtype, device=values_BT.device)
    next_value_B = torch.zeros_like(next_adv_B)
    for t in reversed(range(T)):
        m_B = m_BT[:, t]
        delta_B = rewards_BT[:, t] + gamma * next_value_B - values_BT[:, t]
        a_B = (delta_B + gamma * lam * next_adv_B) * m_B
        adv_BT[:, t] = a_B
        # an unmasked position carries the next step's advantage and value through unchanged
        next_adv_B = torch.where(m_B > 0, a_B, next_adv_B)
        next_value_B = torch.where(m_B > 0, values_BT[:, t], next_value_B)
    return adv_BT, (adv_BT + values_BT) * m_BT
