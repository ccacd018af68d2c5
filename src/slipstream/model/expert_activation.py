"""The experts' gated activations, each with a hand-written backward for the grouped expert path.

An activation reads an expert's fused gate/up projection h (..., 2I) with the gate first (the
internal layout, model/moe_block.py `Experts`) and returns (..., I):
- `SwiGLU` (Qwen3-MoE, Mixtral, OLMoE, GLM): silu(gate) * up.
- `ClampedSwiGLU` (GPT-OSS, `swiglu_alpha` / `swiglu_limit`): (clamp(up, -limit, limit) + 1) *
  g * sigmoid(alpha * g), g = clamp(gate, max=limit), as transformers' `GptOssExperts._apply_gate`
  (which reads gate and up interleaved; the family's weight map de-interleaves on load).
`backward(g_act, h)` returns (dL/dh (..., 2I), the activation itself, for the down projection's
weight gradient), equal to autograd through `__call__` (clamp passes the gradient where the
input lies within its bounds, inclusive, as torch.clamp).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from slipstream.config.model import ModelConfig


class SwiGLU:
    name = "swiglu"

    def __call__(self, h_A2I: torch.Tensor) -> torch.Tensor:
        gate, up = h_A2I.chunk(2, dim=-1)
        return F.silu(gate) * up

    def backward(
        self, g_AI: torch.Tensor, h_A2I: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        gate, up = h_A2I.chunk(2, dim=-1)
        silu = F.silu(gate)
        g_h = torch.cat((torch.ops.aten.silu_backward(g_AI * up, gate), g_AI * silu), dim=-1)
        return g_h, silu * up


_BOUNDS: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
"""`ClampedSwiGLU.bounds` by (limit, device, dtype, width): one pair shared by every layer."""


class ClampedSwiGLU:
    name = "clamped_swiglu"

    def __init__(self, alpha: float, limit: float) -> None:
        self.alpha, self.limit = alpha, limit

    def bounds(self, h_A2I: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(low, high) (2I,) per column: gate (-inf, limit], up [-limit, limit]: both clamps in
        one op (decode is per-op overhead bound). Made once per limit, device, dtype and width
        for all layers (`_BOUNDS`), outside inference mode (autograd may save them)."""
        key = (self.limit, h_A2I.device, h_A2I.dtype, h_A2I.shape[-1])
        b = _BOUNDS.get(key)
        if b is None:
            with torch.inference_mode(False):
                half = h_A2I.shape[-1] // 2
                lo = torch.full((2 * half,), -self.limit, dtype=h_A2I.dtype, device=h_A2I.device)
                lo[:half] = float("-inf")
                hi = torch.full_like(lo, self.limit)
            b = _BOUNDS[key] = (lo, hi)
        return b

    def __call__(self, h_A2I: torch.Tensor) -> torch.Tensor:
        g, up = h_A2I.clamp(*self.bounds(h_A2I)).chunk(2, dim=-1)
        glu = g * torch.sigmoid(g * self.alpha)
        return torch.addcmul(glu, up, glu)  # (up + 1) * glu in one op

    def backward(
        self, g_AI: torch.Tensor, h_A2I: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # both clamps in one op, as the forward; the gradient passes where the clamp left the
        # input as it was (inside the bounds, inclusive: torch.clamp's rule), one mask for the
        # gate and the up half (~7 ops fewer than a mask per half)
        h_c = h_A2I.clamp(*self.bounds(h_A2I))
        g, up_c = h_c.chunk(2, dim=-1)
        sig = torch.sigmoid(g * self.alpha)
        glu = g * sig
        # d glu / d g = sig + alpha * g * sig * (1 - sig) (one addcmul), and
        # d act / d g = g_act * (up + 1) * d glu = t + up * t, t = g_act * d glu (one addcmul)
        d_glu = torch.addcmul(sig, glu, 1 - sig, value=self.alpha)
        t = g_AI * d_glu
        g_h = torch.cat((torch.addcmul(t, up_c, t), g_AI * glu), dim=-1)
        return g_h.mul_(h_c == h_A2I), torch.addcmul(glu, up_c, glu)


Activation = SwiGLU | ClampedSwiGLU


def expert_activation(cfg: ModelConfig) -> Activation:
    """The activation `cfg.expert_activation` names."""
    if cfg.expert_activation == "clamped_swiglu":
        return ClampedSwiGLU(cfg.swiglu_alpha, cfg.swiglu_limit)
    return SwiGLU()
