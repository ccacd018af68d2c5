"""The op-lean paths of issue 47's glm4_moe round against their plain forms: the per-head q/k
norm Function (`rms_norm_qk`), the packed gradient of `Packing.pack`, the shared per-step zeros
(`step_zeros`), partial rotary written in place without autograd, the packed q/k norm + RoPE
Function (`qk_norm_rope_packed`) and unweighted router losses kept out of the graph."""

from __future__ import annotations

import pytest
import torch

from slipstream.config.model import ModelConfig
from slipstream.model import MoEForCausalLM, layers
from slipstream.model.families import family_for
from slipstream.model.layers import Attention, Packing, rms_norm, rms_norm_qk, rope_cos_sin
from slipstream.model.moe_block import router_losses


def _reference_qk_norm(qk, wq, wk, H, eps, one):
    C, Dh = qk.shape[-3 if one else -2], qk.shape[-1]
    table = torch.cat((wq.expand(H, Dh), wk.expand(C - H, Dh)))
    return rms_norm(qk, table.view(C, 1, Dh) if one else table, eps)


def test_qk_norm_function_matches_the_table_norm_values_and_gradients():
    g = torch.Generator().manual_seed(0)
    H, K, Dh = 4, 2, 8
    for shape, one in (((5, H + K, Dh), False), ((3, H + K, 1, Dh), True)):
        x = torch.randn(shape, generator=g)
        wq0, wk0 = 1 + 0.3 * torch.randn(Dh, generator=g), 1 + 0.3 * torch.randn(Dh, generator=g)
        upstream = torch.randn(shape, generator=g)
        outs = []
        for fn in (rms_norm_qk, _reference_qk_norm):
            xi = x.clone().requires_grad_()
            wq, wk = wq0.clone().requires_grad_(), wk0.clone().requires_grad_()
            y = fn(xi, wq, wk, H, 1e-6, one)
            (y * upstream).sum().backward()
            outs.append((y.detach(), xi.grad, wq.grad, wk.grad))
        got, ref = outs
        torch.testing.assert_close(got[0], ref[0], rtol=0, atol=0)  # the same forward
        for a, b, name in zip(got[1:], ref[1:], ("x", "wq", "wk"), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


def test_pack_gradient_is_the_unpacked_gradient_with_zeros_at_the_padding():
    real = torch.tensor([[True, True, True, False], [True, False, False, False]])
    packing = Packing.from_mask(real)
    x = torch.randn(8, 3, requires_grad=True)
    g = torch.randn(4, 3)
    (packing.pack(x) * g).sum().backward()
    expected = torch.zeros(8, 3)
    expected[real.reshape(-1)] = g
    torch.testing.assert_close(x.grad, expected, rtol=0, atol=0)


def test_step_zeros_are_shared_within_a_row_count_and_bounded():
    layers.ZEROS.clear()
    like = torch.empty(0)
    a = layers.step_zeros(7, (5,), like)
    assert layers.step_zeros(7, (5,), like) is a
    b = layers.step_zeros(9, (5,), like)
    assert b.shape == (9, 5) and not b.any()
    assert len(layers.ZEROS) == 1  # one kept per row shape
    layers.ZEROS.clear()


def test_partial_rotary_in_place_equals_the_split_and_cat_path():
    """The no-grad forward (RoPE written over the first rotary dims in place) gives bitwise the
    values of the autograd forward (split, rotate, cat) of the same layer."""
    torch.manual_seed(0)
    attn = Attention(32, 4, 2, 16, 1e-6, 0, qkv_bias=True, rotary_dim=8).eval()
    with torch.no_grad():
        for p in attn.parameters():
            p.add_(0.1 * torch.randn(p.shape))
    x = torch.randn(2, 5, 32)
    cos_sin = rope_cos_sin(torch.arange(5).expand(2, 5), 8, 10000.0, torch.float32)
    attn.fused_inference = False  # the same projection op (F.linear) on both paths
    with torch.no_grad():
        fast = attn(x, cos_sin)
    slow = attn(x, cos_sin)  # autograd on: the split + cat path
    torch.testing.assert_close(fast, slow.detach(), rtol=0, atol=0)


@pytest.mark.parametrize(
    ("qk_norm", "rotary_dim"), [("per_head", 8), ("none", 8), ("per_head", 16)]
)
def test_packed_qk_norm_rope_function_matches_the_padded_forward_and_gradients(qk_norm, rotary_dim):
    """The packed training forward through `qk_norm_rope_packed` (per-head norm or none,
    partial rotary) gives the padded autograd forward's outputs and gradients at the real
    tokens."""
    real = torch.tensor([[True] * 6, [True] * 4 + [False] * 2])
    packing = Packing.from_mask(real)
    torch.manual_seed(0)
    attn = Attention(32, 4, 2, 16, 1e-6, 0, qkv_bias=True, qk_norm=qk_norm,
                     rotary_dim=rotary_dim).train()  # fmt: skip
    with torch.no_grad():
        for p in attn.parameters():
            p.add_(0.2 * torch.randn(p.shape))
    x_BTD = torch.randn(2, 6, 32)
    cos_sin = rope_cos_sin(torch.arange(6).expand(2, 6), rotary_dim, 10000.0, torch.float32)
    upstream = torch.randn(2, 6, 32)

    def run(packed: bool):
        attn.zero_grad(set_to_none=True)
        x = x_BTD.clone().requires_grad_()
        if packed:
            cos_M, sin_M = (t.reshape(12, -1)[packing.rows_M] for t in cos_sin)
            tables = layers.packed_rope_tables(cos_M, sin_M)
            out = attn(packing.pack(x.reshape(12, 32)), tables, packing=packing)
            out = packing.unpack(out).view(2, 6, 32)
        else:
            out = attn(x, cos_sin)
        (out * upstream * real[..., None]).sum().backward()
        grads = {n: p.grad for n, p in attn.named_parameters()}
        return out.detach()[real], x.grad[real], grads

    got, ref = run(True), run(False)
    torch.testing.assert_close(got[0], ref[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[1], ref[1], rtol=1e-4, atol=1e-6)
    for name, g in ref[2].items():
        torch.testing.assert_close(got[2][name], g, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("aux_coef", [0.0, 0.01])
def test_router_losses_join_the_graph_only_when_weighted(aux_coef):
    """With both router-loss coefficients 0 (GLM-4.5) the losses are statistics without a graph
    (backward skips them), the same values; weighted, the aux loss carries the gradient."""
    family = family_for("glm4_moe")
    fields = {**family.config_from_hf(family.tiny_hf_config()), "router_aux_loss_coef": aux_coef}
    torch.manual_seed(0)
    model = MoEForCausalLM(ModelConfig(model_type="glm4_moe", **fields)).train()
    ids = torch.randint(
        0, model.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(3)
    )
    out = model(ids)
    assert out.aux_loss.requires_grad == (aux_coef != 0)
    lb, z = router_losses(out.router_logits, model.config.num_experts,
                          model.config.num_experts_per_tok)  # fmt: skip
    torch.testing.assert_close(out.load_balance_loss, lb.detach(), rtol=0, atol=0)
    torch.testing.assert_close(out.z_loss, z.detach(), rtol=0, atol=0)


def test_kept_constants_are_never_replaced_and_bounded():
    """Inference constants a captured CUDA graph may read stay put (a later row count adds one,
    it does not replace the first); too many rows or a full cache: None (the caller makes its
    own)."""
    layers.ZEROS.clear()
    a = layers.kept_full(4, (3, 1), True, torch.bool, "cpu")
    b = layers.kept_full(8, (3, 1), True, torch.bool, "cpu")
    assert a is not None and b is not None and bool(a.all()) and b.shape == (8, 3, 1)
    assert layers.kept_full(4, (3, 1), True, torch.bool, "cpu") is a
    assert layers.kept_full(layers.KEPT_MAX_ROWS + 1, (3, 1), True, torch.bool, "cpu") is None
    for rows in range(layers.KEPT_MAX):
        layers.kept_full(16 + rows, (3, 1), True, torch.bool, "cpu")
    assert sum(1 for k in layers.ZEROS if k[0] == "kept") == layers.KEPT_MAX
    assert layers.kept_full(15, (3, 1), True, torch.bool, "cpu") is None
    assert layers.kept_full(4, (3, 1), True, torch.bool, "cpu") is a
    layers.ZEROS.clear()


def test_packed_rope_function_rounds_bf16_gradients_as_autograd():
    """bf16 q/k/v heads with float32 RoPE tables (autocast training): without a norm the
    Function's values and input gradient are bitwise autograd's through split, rotation and
    cats (each product's gradient rounded to bf16 before the two are added)."""
    g = torch.Generator().manual_seed(0)
    M, H, K, Dh, rd = 5, 4, 2, 16, 8
    qkv0 = torch.randn(M, H + 2 * K, Dh, generator=g).to(torch.bfloat16)
    cos_sin = rope_cos_sin(torch.arange(M)[None], rd, 10000.0, torch.float32)
    cos, sin = layers.packed_rope_tables(cos_sin[0][0], cos_sin[1][0])
    upstream = torch.randn(M, H + 2 * K, Dh, generator=g).to(torch.bfloat16)

    qkv = qkv0.clone().requires_grad_()
    out = layers.qk_norm_rope_packed(qkv, H, rd, cos, sin, None)
    (out.float() * upstream.float()).sum().backward()

    ref_in = qkv0.clone().requires_grad_()
    qk, v = ref_in.split((H + K, K), dim=1)
    rot, keep = qk.split((rd, Dh - rd), dim=-1)
    rot = rot * cos + rot.roll(rd // 2, -1) * sin
    ref = torch.cat((torch.cat((rot, keep), dim=-1), v.to(rot.dtype)), dim=1)
    (ref * upstream.float()).sum().backward()

    torch.testing.assert_close(out, ref.to(torch.bfloat16), rtol=0, atol=0)
    torch.testing.assert_close(qkv.grad, ref_in.grad, rtol=0, atol=0)
