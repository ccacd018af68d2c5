"""The loss mask of multi-turn samples: observation tokens are in no loss term.

Each test trains one step on samples whose completions interleave sampled tokens (mask 1) and
observation tokens (mask 0), and checks the trainer's reported terms against the same terms
computed independently here, over an explicit list of the sampled positions only (per-sample
forwards, no padding, no mask tensors): policy loss (with the truncated IS weight on behaviour
logprobs that exist only for sampled tokens), token count, entropy, k3 KL to a reference that
differs from the policy, and PPO's GAE returns and value loss. Counting any observation token
in any term, or treating an observation as the end of an episode in GAE, changes a figure.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from slipstream.config.model import ModelConfig
from slipstream.config.rl import TrainerConfig
from slipstream.model import MoEForCausalLM
from slipstream.rl.advantages import gae
from slipstream.rl.trainer import Trainer, collate
from slipstream.rl.types import Batch, Group, Sample, TaskRef


def tiny_model(seed: int = 0) -> MoEForCausalLM:
    torch.manual_seed(seed)
    return MoEForCausalLM(
        ModelConfig(
            vocab_size=16,
            hidden_size=16,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=8,
            intermediate_size=32,
            moe_intermediate_size=16,
            num_experts=4,
            num_experts_per_tok=2,
            max_position_embeddings=32,
            router_aux_loss_coef=0.0,
        )  # fmt: skip
    )


# (prompt, completion, mask, reward): two turns with an observation between them, and one
# turn with two observations; the rest single-turn. Behaviour logprobs/versions: sampled only.
SPECS = [
    ([1, 3], [4, 5, 11, 12, 13, 6, 2], [1, 1, 0, 0, 0, 1, 1], 1.0),
    ([1, 3], [7, 14, 8, 15, 15, 9, 2], [1, 0, 1, 0, 0, 1, 1], 0.0),
    ([1, 3], [5, 2], [], 1.0),
    ([1, 3], [7, 8, 9], [], 0.0),
]


def make_samples(version: int = 0) -> list[Sample]:
    out = []
    for k, (prompt, comp, mask, reward) in enumerate(SPECS):
        n = sum(mask) if mask else len(comp)
        lps = [-1.5 - 0.25 * ((i + k) % 3) for i in range(n)]
        out.append(Sample(prompt, comp, lps, [version] * n, reward=reward, loss_mask=mask))
    return out


def sampled_positions(s: Sample) -> list[int]:
    p = len(s.prompt_ids)
    return [p - 1 + i for i, m in enumerate(s.mask) if m]


def per_position(model: torch.nn.Module, s: Sample) -> tuple[torch.Tensor, torch.Tensor]:
    """(logp of each target, logits) of one sample's forward, no padding."""
    seq = s.prompt_ids + s.completion_ids
    with torch.no_grad():
        logits = model(torch.tensor([seq[:-1]])).logits_BTV[0].float()
    logp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(seq[1:])[:, None])[:, 0]
    return logp, logits


def test_sample_mask_contract() -> None:
    s = make_samples()[0]
    assert s.num_sampled == 4 and s.mask == SPECS[0][2]
    with pytest.raises(ValueError, match="sampled completion tokens"):
        Sample([1], [4, 5, 11], [-1.0, -1.0, -1.0], [0, 0, 0], loss_mask=[1, 1, 0])
    with pytest.raises(ValueError, match="loss mask of"):
        Sample([1], [4, 5], [-1.0], [0], loss_mask=[1])
    # staleness counts sampled tokens only: observations have no version to be stale by
    old = Sample([1], [4, 11, 5], [-1.0, -1.0], [7, 9], loss_mask=[1, 0, 1])
    assert old.oldest_version == 7


def test_collate_masks_observations_and_places_behaviour_on_sampled_tokens() -> None:
    samples = make_samples()
    samples[1].versions[:] = [3, 4, 5, 5]  # a later turn under newer weights
    t = collate(samples, pad_id=0, device=torch.device("cpu"))
    for b, s in enumerate(samples):
        pos = sampled_positions(s)
        assert torch.nonzero(t["mask_BT"][b]).flatten().tolist() == pos
        assert t["behaviour_BT"][b, pos].tolist() == pytest.approx(s.behaviour_logprobs)
        seq = s.prompt_ids + s.completion_ids
        assert t["inputs_BT"][b, : len(seq) - 1].tolist() == seq[:-1]  # ids as sampled/observed
        assert t["targets_BT"][b, : len(seq) - 1].tolist() == seq[1:]
    # observation positions carry the version of the next sampled token (whose turn read them)
    v = t["version_BT"][1].tolist()
    p = len(samples[1].prompt_ids)
    assert v[p - 1 : p - 1 + 7] == [3, 4, 4, 5, 5, 5, 5]


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean"])
def test_every_grpo_loss_term_ignores_observation_tokens(aggregation: str) -> None:
    model = tiny_model()
    cfg = TrainerConfig(lr=1e-3, loss="grpo", entropy_coef=0.01, kl_coef=0.1, is_cap=1.5,
                        aggregation=aggregation, std_norm=False)  # fmt: skip
    trainer = Trainer(model, cfg, pad_id=0)
    with torch.no_grad():  # a reference that differs from the policy, so KL is not 0
        for p in trainer.ref_model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    before = copy.deepcopy(model)
    ref = copy.deepcopy(trainer.ref_model)
    samples = make_samples()
    batch = Batch([Group(TaskRef(0, 0), samples)], trainer_version=0)
    m = trainer.step(batch)

    rewards = torch.tensor([s.reward for s in samples])
    adv = (rewards - rewards.mean()).tolist()
    pg, ent, kl, counts = [], [], [], []
    for s, a in zip(samples, adv, strict=True):
        pos = sampled_positions(s)
        logp, logits = per_position(before, s)
        ref_logp, _ = per_position(ref, s)
        lp = logp[pos]
        w = torch.exp(lp - torch.tensor(s.behaviour_logprobs)).clamp(max=cfg.is_cap)
        h = -(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum(-1)[pos]
        d = ref_logp[pos] - lp
        pg.append((-w * a).tolist())
        ent.append(h.tolist())
        kl.append((torch.exp(d) - d - 1).tolist())
        counts.append(len(pos))

    def agg(xs: list[list[float]]) -> float:
        if aggregation == "token_mean":
            return sum(map(sum, xs)) / sum(counts)
        return sum(sum(x) / len(x) for x in xs) / len(xs)

    assert m["num_tokens"] == sum(counts) == 4 + 4 + 2 + 3
    assert m["pg_loss"] == pytest.approx(agg(pg), rel=1e-4, abs=1e-6)
    assert m["entropy"] == pytest.approx(agg(ent), rel=1e-4)
    assert m["kl"] == pytest.approx(agg(kl), rel=1e-4, abs=1e-7)
    assert m["kl"] > 1e-4  # the check above had something to compare
    assert m["completion_len_mean"] == pytest.approx(sum(counts) / len(counts))


def test_ppo_gae_and_value_loss_skip_observation_tokens() -> None:
    model = tiny_model(1)
    cfg = TrainerConfig(lr=1e-3, loss="ppo", ppo_gamma=1.0, ppo_lambda=0.9, value_coef=0.5)
    trainer = Trainer(model, cfg, pad_id=0)
    samples = make_samples()
    m = trainer.step(Batch([Group(TaskRef(0, 0), samples)], trainer_version=0))
    # the critic's head starts at zero: V = 0 everywhere, so the return of a sampled token is
    # lam^(sampled tokens after it) * reward -- observation tokens are passed over, not steps
    # and not episode ends (an end there would zero the first turn's returns)
    sq = []
    for s in samples:
        n = len(sampled_positions(s))
        sq += [(cfg.ppo_lambda ** (n - 1 - j) * s.reward) ** 2 for j in range(n)]
    assert m["value_loss"] == pytest.approx(0.5 * sum(sq) / len(sq), rel=1e-5)


def test_gae_hand_values_across_an_observation_hole() -> None:
    # positions 0-1 sampled, 2-3 observation, 4-5 sampled (reward at 5), 6 padding
    mask = torch.tensor([[1, 1, 0, 0, 1, 1, 0]], dtype=torch.bool)
    values = torch.tensor([[0.5, 0.25, 9.0, 9.0, 0.125, 0.0625, 9.0]])
    rewards = torch.zeros(1, 7)
    rewards[0, 5] = 1.0
    adv, ret = gae(rewards, values, mask, gamma=1.0, lam=0.5)
    steps = [0, 1, 4, 5]
    v = [values[0, i].item() for i in steps]
    r = [0.0, 0.0, 0.0, 1.0]
    want, nxt_a, nxt_v = [0.0] * 4, 0.0, 0.0
    for j in reversed(range(4)):
        delta = r[j] + nxt_v - v[j]
        want[j] = delta + 0.5 * nxt_a
        nxt_a, nxt_v = want[j], v[j]
    assert adv[0, steps].tolist() == pytest.approx(want)
    assert adv[0, [2, 3, 6]].tolist() == [0.0, 0.0, 0.0]
    assert ret[0, steps].tolist() == pytest.approx([a + b for a, b in zip(want, v, strict=True)])
    assert not math.isclose(want[1], 0.0 - v[1])  # an episode end at the hole would give this
