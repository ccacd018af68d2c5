"""The no-grad inference path of the model (fused q/k/v projection, joint q/k RMSNorm and RoPE,
matmul decode attention) computes the same function as the autograd path, and the fused weight
cache follows in-place weight updates (the engine's hot-swap)."""

import pytest
import torch

from cacheutil import decode_rows, extend_rows
from slipstream.config.model import ModelConfig
from slipstream.engine.kv_cache import SlotKVCache
from slipstream.model import MoEForCausalLM, load_hf_state_dict


def _model(seed: int, **kw) -> MoEForCausalLM:
    torch.manual_seed(seed)
    cfg = dict(vocab_size=61, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
               moe_intermediate_size=32, max_position_embeddings=64, initializer_range=0.2)  # fmt: skip
    cfg.update(kw)
    return MoEForCausalLM(ModelConfig(**cfg)).eval()


def _ids(batch: int = 3, seq: int = 10) -> torch.Tensor:
    return torch.randint(0, 61, (batch, seq), generator=torch.Generator().manual_seed(7))


@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_no_grad_forward_equals_autograd_forward(kv_heads):
    model, ids = _model(0, num_key_value_heads=kv_heads), _ids()
    ref = model(ids).logits_BTV  # autograd path: separate projections and norms
    assert ref.requires_grad
    with torch.no_grad():
        fused = model(ids).logits_BTV
    with torch.inference_mode():
        fused_im = model(ids).logits_BTV
    torch.testing.assert_close(fused, ref.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fused_im, ref.detach(), atol=1e-5, rtol=1e-5)


def test_cached_decode_equals_full_forward_no_grad():
    model, ids = _model(1), _ids(seq=12)
    with torch.no_grad():
        full = model(ids).logits_BTV
        cache = SlotKVCache.for_model(model, ids.shape[0], 16)
        steps = [extend_rows(model, cache, ids[:, :5], start=0)]
        steps += [decode_rows(model, cache, ids[:, t : t + 1], pos=t) for t in range(5, 12)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)


def test_fused_cache_follows_in_place_weight_updates():
    model, other, ids = _model(2), _model(3), _ids()
    with torch.no_grad():
        before = model(ids).logits_BTV  # builds the fused q/k/v cache from the old weights
        load_hf_state_dict(model, other.state_dict())  # in place, as the engine's hot-swap
        after = model(ids).logits_BTV
        expected = other(ids).logits_BTV
        assert not torch.allclose(before, expected, atol=1e-3)
        torch.testing.assert_close(after, expected, atol=1e-6, rtol=1e-6)
        # a single q/k norm weight changing is enough to rebuild
        model.model.layers[0].self_attn.k_norm.weight.mul_(2.0)
        changed = model(ids).logits_BTV
    torch.testing.assert_close(changed, model(ids).logits_BTV.detach(), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(changed, expected, atol=1e-4)


def test_fused_cache_follows_dtype_change():
    model, ids = _model(4), _ids()
    with torch.no_grad():
        model(ids)
        model.to(torch.float64)
        out = model(ids).logits_BTV
    torch.testing.assert_close(out, model(ids).logits_BTV.detach(), atol=1e-10, rtol=1e-10)


def test_fused_cache_does_not_survive_a_fused_adamw_step():
    """The RL job evaluates the trainer's own module between steps: fused AdamW updates the
    weights in place without moving their version counters, so the cache must not outlive the
    train/eval switch (it served the pre-training q/k/v weights to every later evaluation)."""
    model, ids = _model(5), _ids()
    with torch.no_grad():
        model(ids)  # eval mode: builds the fused cache
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    model(ids).logits_BTV.square().mean().backward()
    q_weight = model.model.layers[0].self_attn.q_proj.weight
    version, before = q_weight._version, q_weight.detach().clone()
    opt.step()
    assert q_weight._version == version and not torch.equal(q_weight, before)  # the trap itself
    model.eval()
    fresh = _model(6)
    fresh.load_state_dict(model.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits_BTV, fresh(ids).logits_BTV,
                                   atol=1e-6, rtol=1e-6)  # fmt: skip
        with_grad_off_in_train = model.train()(ids).logits_BTV  # train mode: unfused path
    torch.testing.assert_close(with_grad_off_in_train, fresh(ids).logits_BTV, atol=1e-5, rtol=1e-5)
