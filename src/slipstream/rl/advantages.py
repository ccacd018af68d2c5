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
    """Generalised advantage estimation over right-padded sequences.

    delta_t = r_t + gamma * V_{t+1} * m_{t+1} - V_t;  A_t = delta_t + gamma * lam * m_{t+1} * A_{t+1}.
    Value after the last valid token is 0 (episodes end with the completion). Returns
    (advantages_BT, returns_BT = advantages + values), both zero on padding."""
    mask_BT = mask_BT.to(values_BT.dtype)
    values_BT = values_BT.detach() * mask_BT
    B, T = rewards_BT.shape
    adv_BT = torch.zeros_like(values_BT)
    next_adv_B = torch.zeros(B, dtype=values_BT.dtype, device=values_BT.device)
    next_value_B = torch.zeros_like(next_adv_B)
    next_mask_B = torch.zeros_like(next_adv_B)
    for t in reversed(range(T)):
        delta_B = rewards_BT[:, t] + gamma * next_value_B * next_mask_B - values_BT[:, t]
        next_adv_B = (delta_B + gamma * lam * next_mask_B * next_adv_B) * mask_BT[:, t]
        adv_BT[:, t] = next_adv_B
        next_value_B = values_BT[:, t]
        next_mask_B = mask_BT[:, t]
    return adv_BT, (adv_BT + values_BT) * mask_BT
