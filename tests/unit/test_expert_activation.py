"""The experts' activations' hand-written backward (model/expert_activation.py) against autograd
through the definition: the clamped SwiGLU with both clamps biting and inputs exactly at the
bounds (torch.clamp passes the gradient there), and its forward against the eager formula."""

from __future__ import annotations

import torch

from slipstream.model.expert_activation import ClampedSwiGLU, SwiGLU


def _eager_clamped_swiglu(h_A2I: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """transformers' `GptOssExperts._apply_gate`, on the gate-first layout."""
    gate, up = h_A2I.chunk(2, dim=-1)
    gate = gate.clamp(min=None, max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def _inputs(limit: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    h = torch.randn(37, 2 * 24, generator=g) * 3 * limit  # many past the bounds
    h[0, :3] = limit  # gate at its max, up at both bounds: the gradient passes (inclusive)
    h[0, 24:26] = torch.tensor([limit, -limit])
    h[1, :2] = torch.tensor([-40.0, 40.0])  # far below (no lower gate clamp), far above
    return h


def test_clamped_swiglu_forward_and_backward_equal_autograd() -> None:
    alpha, limit = 1.702, 0.7
    act = ClampedSwiGLU(alpha, limit)
    h = _inputs(limit).requires_grad_(True)
    ref = _eager_clamped_swiglu(h, alpha, limit)
    g_act = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1))
    (g_ref,) = torch.autograd.grad(ref, h, g_act)
    with torch.no_grad():
        torch.testing.assert_close(act(h), ref, atol=1e-6, rtol=1e-6)
        g_h, act_out = act.backward(g_act, h)
    torch.testing.assert_close(act_out, ref.detach(), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(g_h, g_ref, atol=1e-6, rtol=1e-5)
    assert g_ref[0, :3].ne(0).all() and g_ref[0, 24:26].ne(0).all()  # the bounds pass it


def test_clamped_swiglu_autograd_through_the_forward() -> None:
    """The forward differentiates (the per-segment fallback and EP paths run autograd on it)."""
    alpha, limit = 1.702, 0.7
    h = _inputs(limit).requires_grad_(True)
    g_act = torch.randn(37, 24, generator=torch.Generator().manual_seed(2))
    (got,) = torch.autograd.grad(ClampedSwiGLU(alpha, limit)(h), h, g_act)
    (ref,) = torch.autograd.grad(_eager_clamped_swiglu(h, alpha, limit), h, g_act)
    torch.testing.assert_close(got, ref, atol=1e-6, rtol=1e-5)


def test_swiglu_backward_equals_autograd() -> None:
    h = torch.randn(11, 16, generator=torch.Generator().manual_seed(3), requires_grad=True)
    ref = SwiGLU()(h)
    g_act = torch.randn(ref.shape, generator=torch.Generator().manual_seed(4))
    (g_ref,) = torch.autograd.grad(ref, h, g_act)
    with torch.no_grad():
        g_h, act_out = SwiGLU().backward(g_act, h)
    torch.testing.assert_close(g_h, g_ref)
    torch.testing.assert_close(act_out, ref.detach())
