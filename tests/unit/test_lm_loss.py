"""model/lm_loss.py: the chunked LM head + log-softmax equals the full float32 logits path
within 1e-5 (log-probs, entropies and their gradients), and the trainer's step through it equals
the step through the full logits."""

from __future__ import annotations

import copy

import pytest
import torch

from slipstream.config.rl import TrainerConfig
from slipstream.model.lm_loss import chunked_logprobs
from slipstream.rl.losses import entropy_from_logits, token_logprobs
from slipstream.rl.trainer import Trainer
from unit.test_rl_trainer import make_batch, tiny_model


@pytest.mark.parametrize("chunk", [1, 7, 64, 1000])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_equals_full_logits(chunk: int, temperature: float) -> None:
    torch.manual_seed(0)
    N, D, V = 50, 16, 97
    h = torch.randn(N, D, requires_grad=True)
    w = (0.5 * torch.randn(V, D)).requires_grad_(True)
    targets = torch.randint(0, V, (N,))
    g_logp, g_ent = torch.randn(N), torch.randn(N)

    logits = (h @ w.t()).float() / temperature
    ref_logp = token_logprobs(logits, targets)
    ref_ent = entropy_from_logits(logits)
    ref_gh, ref_gw = torch.autograd.grad((ref_logp * g_logp + ref_ent * g_ent).sum(), (h, w))

    logp, ent = chunked_logprobs(h, w, targets, chunk_tokens=chunk, temperature=temperature,
                                 with_entropy=True)  # fmt: skip
    assert ent is not None
    gh, gw = torch.autograd.grad((logp * g_logp + ent * g_ent).sum(), (h, w))
    for got, ref in ((logp, ref_logp), (ent, ref_ent), (gh, ref_gh), (gw, ref_gw)):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_chunked_rejects_a_zero_chunk() -> None:
    with pytest.raises(ValueError, match="chunk_tokens"):
        chunked_logprobs(torch.zeros(2, 4), torch.zeros(3, 4), torch.zeros(2, dtype=torch.long),
                         chunk_tokens=0)  # fmt: skip


def test_trainer_step_chunked_equals_full_logits() -> None:
    model = tiny_model()
    runs = {}
    for chunk in (0, 5):
        m = copy.deepcopy(model)
        cfg = TrainerConfig(lr=1e-2, entropy_coef=0.01, logits_chunk_tokens=chunk)
        trainer = Trainer(m, cfg, pad_id=0)
        metrics = [trainer.step(make_batch()) for _ in range(2)]
        runs[chunk] = (metrics, m.state_dict())
    (m_full, sd_full), (m_chunk, sd_chunk) = runs[0], runs[5]
    for key in ("pg_loss", "entropy", "aux_loss", "grad_norm", "loss"):
        assert m_chunk[-1][key] == pytest.approx(m_full[-1][key], rel=1e-5, abs=1e-6), key
    for name, p in sd_full.items():
        torch.testing.assert_close(sd_chunk[name], p, rtol=1e-5, atol=1e-6)
