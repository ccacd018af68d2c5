"""Gated DeltaNet (model/gated_deltanet.py) against transformers' own Qwen3-Next and Qwen3.5
modules on the same weights (fp32): the layer, both projection layouts, the chunked and the
recurrent forms, decode state, sequence packing, the zero-centred norms."""

from __future__ import annotations

import pytest
import torch

from slipstream.model.gated_attention import GatedAttention
from slipstream.model.gated_deltanet import (
    GatedDeltaNet,
    RMSNormGated,
    ZeroCenteredRMSNorm,
    chunk_gated_delta_rule,
    fuse_qwen3_next_projections,
    recurrent_gated_delta_rule,
    split_qwen3_next_projections,
)

transformers = pytest.importorskip("transformers")
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as hf35  # noqa: E402
from transformers.models.qwen3_next import modeling_qwen3_next as hfnext  # noqa: E402

DIMS = dict(hidden_size=32, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=8, linear_value_head_dim=6, linear_conv_kernel_dim=4)  # fmt: skip
T_LONG = 150  # crosses two chunk boundaries (64, 128)


def _ours() -> GatedDeltaNet:
    torch.manual_seed(0)
    m = GatedDeltaNet(32, 2, 4, 8, 6, 4, 1e-6, layer_idx=0)
    with torch.no_grad():  # non-trivial values everywhere (defaults are ones / zeros)
        m.dt_bias.normal_(0, 0.5)
        m.norm.weight.normal_(1, 0.2)
        for lin in (m.in_proj_qkv, m.in_proj_z, m.in_proj_b, m.in_proj_a, m.out_proj):
            lin.weight.normal_(0, 0.3)
        m.conv1d.weight.normal_(0, 0.5)
    return m


def _hf_config(cls):
    return cls(
        **DIMS, num_hidden_layers=1, layer_types=["linear_attention"], num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, rms_norm_eps=1e-6, vocab_size=64, num_experts=2,
        num_experts_per_tok=1, moe_intermediate_size=8, shared_expert_intermediate_size=8,
    )  # fmt: skip


def _hf35(ours: GatedDeltaNet):
    hf = hf35.Qwen3_5MoeGatedDeltaNet(_hf_config(transformers.Qwen3_5MoeTextConfig), 0)
    hf.load_state_dict(ours.state_dict())
    return hf.eval()


def _hfnext(ours: GatedDeltaNet):
    hf = hfnext.Qwen3NextGatedDeltaNet(_hf_config(transformers.Qwen3NextConfig), 0)
    sd = dict(ours.state_dict())
    parts = {
        k: sd.pop(f"{k}.weight") for k in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
    }
    qkvz, ba = fuse_qwen3_next_projections(parts, 2, 4, 8, 6)
    hf.load_state_dict({**sd, "in_proj_qkvz.weight": qkvz, "in_proj_ba.weight": ba})
    return hf.eval()


def _x(B: int = 2, T: int = T_LONG) -> torch.Tensor:
    return torch.randn(B, T, 32, generator=torch.Generator().manual_seed(1))


def test_layer_equals_transformers_qwen3_5_and_qwen3_next():
    ours, x = _ours(), _x()
    with torch.no_grad():
        out = ours(x)
        torch.testing.assert_close(out, _hf35(ours)(x), atol=1e-5, rtol=0)
        torch.testing.assert_close(out, _hfnext(ours)(x), atol=1e-5, rtol=0)


def test_qwen3_next_projection_layouts_round_trip_exactly():
    g = torch.Generator().manual_seed(2)
    qkvz, ba = (
        torch.randn(2 * (16 + 2 * 2 * 6), 32, generator=g),
        torch.randn(2 * 4, 32, generator=g),
    )
    parts = split_qwen3_next_projections(qkvz, ba, 2, 4, 8, 6)
    assert {k: tuple(v.shape) for k, v in parts.items()} == {
        "in_proj_qkv": (56, 32), "in_proj_z": (24, 32), "in_proj_b": (4, 32), "in_proj_a": (4, 32)
    }  # fmt: skip
    qkvz2, ba2 = fuse_qwen3_next_projections(parts, 2, 4, 8, 6)
    assert torch.equal(qkvz, qkvz2) and torch.equal(ba, ba2)


def _rule_inputs(T: int, requires_grad: bool = False):
    g = torch.Generator().manual_seed(3)
    q, k = torch.randn(2, T, 2, 8, generator=g), torch.randn(2, T, 2, 8, generator=g)
    v = torch.randn(2, T, 4, 6, generator=g)
    decay = -torch.rand(2, T, 4, generator=g) * 2
    beta = torch.rand(2, T, 4, generator=g)
    S0 = torch.randn(2, 4, 8, 6, generator=g) * 0.1
    ts = [q, k, v, decay, beta, S0]
    return [t.requires_grad_(requires_grad) for t in ts]


def test_chunked_equals_recurrent_across_chunk_boundaries_with_gradients():
    ins = _rule_inputs(T_LONG, requires_grad=True)
    out_c, S_c = chunk_gated_delta_rule(*ins)
    grads_c = torch.autograd.grad((out_c.square().sum() + S_c.sum()), ins)
    out_r, S_r = recurrent_gated_delta_rule(*ins)
    grads_r = torch.autograd.grad((out_r.square().sum() + S_r.sum()), ins)
    torch.testing.assert_close(out_c, out_r, atol=1e-5, rtol=0)
    torch.testing.assert_close(S_c, S_r, atol=1e-5, rtol=0)
    for gc, gr in zip(grads_c, grads_r, strict=True):
        torch.testing.assert_close(gc, gr, atol=1e-4, rtol=1e-5)
    # and equal to transformers' own chunked form
    q, k, v, decay, beta, S0 = (t.detach() for t in ins)
    hf_out, hf_S = hfnext.torch_chunk_gated_delta_rule(
        q,
        k,
        v,
        decay,
        beta,
        initial_state=S0,
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    torch.testing.assert_close(out_c.detach(), hf_out, atol=1e-5, rtol=0)
    torch.testing.assert_close(S_c.detach(), hf_S, atol=1e-5, rtol=0)


def test_layer_gradients_equal_transformers():
    ours, x = _ours(), _x(T=70)
    hf = _hf35(ours).train()
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    ours(x1).square().sum().backward()
    hf(x2).square().sum().backward()
    torch.testing.assert_close(x1.grad, x2.grad, atol=1e-5, rtol=1e-5)
    hf_params = dict(hf.named_parameters())
    for name, p in ours.named_parameters():
        torch.testing.assert_close(p.grad, hf_params[name].grad, atol=1e-4, rtol=1e-5, msg=name)


def test_decode_state_continues_prefill_then_tokens():
    """Prefill 70 tokens (chunked, from a zero state), then one token at a time (recurrent):
    the same outputs as one forward over all of them."""
    ours, x = _ours(), _x(T=80)
    with torch.no_grad():
        full = ours(x)
        state = ours.new_state(2, torch.float32, x.device)
        parts = [ours(x[:, :70], state)]
        parts += [ours(x[:, t : t + 1], state) for t in range(70, 76)]
        parts.append(ours(x[:, 76:], state))  # a chunk of 4 on top of the state
    torch.testing.assert_close(torch.cat(parts, dim=1), full, atol=1e-5, rtol=1e-5)


def test_packed_sequences_reset_state_at_every_boundary():
    ours = _ours()
    lengths = [70, 5, 1, 66]
    seqs = [torch.randn(n, 32, generator=torch.Generator().manual_seed(n)) for n in lengths]
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    x_MD = torch.cat(seqs).requires_grad_()
    packed = ours.forward_packed(x_MD, cu)
    for s, (a, b) in zip(seqs, zip(cu, cu[1:], strict=False), strict=True):
        with torch.no_grad():
            torch.testing.assert_close(packed[a:b].detach(), ours(s[None])[0], atol=1e-5, rtol=0)
    packed.sum().backward()  # differentiable
    assert x_MD.grad is not None and torch.isfinite(x_MD.grad).all()
    with pytest.raises(ValueError, match="cu_seqlens"):
        ours.forward_packed(x_MD, [0, 10, 5, x_MD.shape[0]])


def test_norms_equal_transformers():
    x, gate = torch.randn(3, 5, 6), torch.randn(3, 5, 6)
    ours = ZeroCenteredRMSNorm(6, 1e-6)
    hf = hfnext.Qwen3NextRMSNorm(6, 1e-6)
    with torch.no_grad():
        ours.weight.normal_()
        hf.weight.copy_(ours.weight)
    torch.testing.assert_close(ours(x), hf(x), atol=1e-6, rtol=0)
    torch.testing.assert_close(ours(x.bfloat16()), hf(x.bfloat16()))
    gated, hf_gated = RMSNormGated(6, 1e-6), hfnext.Qwen3NextRMSNormGated(6, 1e-6)
    with torch.no_grad():
        gated.weight.normal_()
        hf_gated.weight.copy_(gated.weight)
    torch.testing.assert_close(gated(x, gate), hf_gated(x, gate), atol=1e-6, rtol=0)


def test_gated_attention_equals_transformers():
    """q_proj twice as wide (per head: q then the output gate), zero-centred q/k norms, RoPE on
    the first quarter of each head (partial_rotary_factor 0.25), GQA; logits and gradients."""
    cfg = transformers.Qwen3NextConfig(
        hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        partial_rotary_factor=0.25, rms_norm_eps=1e-6, num_hidden_layers=1, vocab_size=64,
        layer_types=["full_attention"], num_experts=2, num_experts_per_tok=1,
    )  # fmt: skip
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    hf = hfnext.Qwen3NextAttention(cfg, 0)
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.3)
    ours = GatedAttention(32, 4, 2, 16, 1e-6, 0)
    ours.load_state_dict(hf.state_dict())
    x = torch.randn(2, 20, 32, generator=torch.Generator().manual_seed(1))
    cos_sin = hfnext.Qwen3NextRotaryEmbedding(cfg)(x, torch.arange(20)[None].expand(2, -1))
    assert cos_sin[0].shape[-1] == 4
    mask = torch.full((20, 20), -torch.inf).triu(1)[None, None]
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    out, (ref, _) = ours(x1, cos_sin), hf(x2, cos_sin, mask)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    out.square().sum().backward()
    ref.square().sum().backward()
    torch.testing.assert_close(x1.grad, x2.grad, atol=1e-5, rtol=1e-5)
    hf_params = dict(hf.named_parameters())
    for name, p in ours.named_parameters():
        torch.testing.assert_close(p.grad, hf_params[name].grad, atol=1e-4, rtol=1e-5, msg=name)
