"""Advantages, clipped surrogate, truncated IS, k3 KL, aggregation, GAE and value loss against
hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from slipstream.rl.advantages import gae, grpo_advantages
from slipstream.rl.losses import (
    aggregate,
    clipped_policy_loss,
    clipped_value_loss,
    entropy_from_logits,
    kl_k3,
    token_logprobs,
    truncated_is_weights,
)


def test_grpo_advantages_hand_values() -> None:
    adv = grpo_advantages(torch.tensor([[0.0, 1.0], [1.0, 1.0]]), std_norm=True)
    assert adv[0].tolist() == pytest.approx([-1.0, 1.0], abs=1e-5)
    assert adv[1].tolist() == [0.0, 0.0]
    adv = grpo_advantages(torch.tensor([[0.0, 0.0, 1.0, 3.0]]), std_norm=False)
    assert adv[0].tolist() == [-1.0, -1.0, 0.0, 2.0]
    # population std of [0,0,1,3] = sqrt(1.5)
    adv = grpo_advantages(torch.tensor([[0.0, 0.0, 1.0, 3.0]]), std_norm=True, eps=0.0)
    assert adv[0].tolist() == pytest.approx([x / math.sqrt(1.5) for x in (-1, -1, 0, 2)])


def test_clipped_surrogate_low_high_and_clip_frac() -> None:
    # ratios 1.5, 1.5, 0.5, 0.5 against advantages +1, -1, +1, -1
    logp = torch.log(torch.tensor([[1.5, 1.5, 0.5, 0.5]])).requires_grad_(True)
    old = torch.zeros(1, 4)
    adv = torch.tensor([[1.0, -1.0, 1.0, -1.0]])
    mask = torch.ones(1, 4)
    loss, stats = clipped_policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28)
    # per token: max(-1.5,-1.28)=-1.28 (clipped), max(1.5,1.28)=1.5, max(-0.5,-0.8)=-0.5,
    # max(0.5,0.8)=0.8 (clipped)
    assert loss.item() == pytest.approx((-1.28 + 1.5 - 0.5 + 0.8) / 4)
    assert float(stats["clip_frac"]) == pytest.approx(0.5)
    loss.backward()
    # clipped tokens carry no gradient; d(-A r)/d logp = -A r on the others, / 4 tokens
    assert logp.grad[0].tolist() == pytest.approx([0.0, 1.5 / 4, -0.5 / 4, 0.0])


def test_truncated_is_weights_and_stats() -> None:
    old = torch.zeros(1, 2)
    behaviour = torch.log(torch.tensor([[0.25, 2.0]]))  # raw ratios 4 and 0.5
    w, raw = truncated_is_weights(old, behaviour, cap=2.0)
    assert w.tolist()[0] == pytest.approx([2.0, 0.5])
    assert raw.tolist()[0] == pytest.approx([4.0, 0.5])
    w, _ = truncated_is_weights(old, behaviour, cap=0.0)
    assert w.tolist()[0] == [1.0, 1.0]
    logp = torch.zeros(1, 2, requires_grad=True)
    adv = torch.tensor([[1.0, 1.0]])
    loss, stats = clipped_policy_loss(
        logp, old, adv, torch.ones(1, 2), behaviour_logp_BT=behaviour, is_cap=2.0
    )
    assert loss.item() == pytest.approx(-(2.0 + 0.5) / 2)
    assert float(stats["is_ratio_mean"]) == pytest.approx(2.25)
    assert float(stats["is_truncated_frac"]) == pytest.approx(0.5)


def test_aggregation_token_vs_sequence_mean() -> None:
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 100.0, 100.0]])
    m = torch.tensor([[1, 1, 1], [1, 0, 0]])
    assert aggregate(x, m, "token_mean").item() == pytest.approx(10 / 4)
    assert aggregate(x, m, "seq_mean").item() == pytest.approx((2 + 4) / 2)
    with pytest.raises(ValueError, match="bogus"):
        aggregate(x, m, "bogus")  # type: ignore[arg-type]


def test_kl_k3_entropy_logprobs() -> None:
    assert kl_k3(torch.tensor([0.0]), torch.log(torch.tensor([0.5]))).item() == pytest.approx(
        0.5 + math.log(2) - 1
    )
    assert kl_k3(torch.tensor([-1.0]), torch.tensor([-1.0])).item() == 0.0
    logits = torch.log(torch.tensor([[[0.5, 0.25, 0.25]]]))
    assert entropy_from_logits(logits).item() == pytest.approx(1.5 * math.log(2))
    assert token_logprobs(logits, torch.tensor([[1]])).item() == pytest.approx(math.log(0.25))


def test_gae_hand_values_with_padding() -> None:
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 1.0, 0.0]])
    values = torch.tensor([[0.5, 0.6, 0.7], [0.2, 0.4, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    adv, ret = gae(rewards, values, mask, gamma=1.0, lam=0.5)
    assert adv[0].tolist() == pytest.approx([0.225, 0.25, 0.3])
    assert ret[0].tolist() == pytest.approx([0.725, 0.85, 1.0])
    assert adv[1].tolist() == pytest.approx([0.5, 0.6, 0.0])
    # gamma < 1 discounts: one step, reward 1 at the end, V = 0 -> A_0 = gamma * lam * 1
    adv, _ = gae(
        torch.tensor([[0.0, 1.0]]), torch.zeros(1, 2), torch.ones(1, 2), gamma=0.9, lam=1.0
    )
    assert adv[0].tolist() == pytest.approx([0.9, 1.0])


def test_clipped_value_loss_hand_value() -> None:
    loss = clipped_value_loss(
        torch.tensor([[1.0]]),
        torch.tensor([[0.0]]),
        torch.tensor([[2.0]]),
        torch.ones(1, 1),
        clip=0.2,
    )
    assert loss.item() == pytest.approx(0.5 * (0.2 - 2.0) ** 2)
