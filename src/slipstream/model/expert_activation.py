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
                lo = torch.full((half,), -self.limit, dtype=h_A2I.dtype, device=h_A2I.device)
                lo = F.pad(lo, (half, 0), value=float("-inf"))  # the gate's half first
                hi = torch.full_like(lo, self.limit)
            b = _BOUNDS[key] = (lo, hi)
        return b

    def _glu(self, g_AI: torch.Tensor) -> torch.Tensor:
        """g * sigmoid(alpha * g) in one op: softplus_beta's derivative is sigmoid(beta * x), so
        `softplus_backward(grad=g, x=g, beta=alpha)` is g * sigmoid(alpha * g) (as
        g * exp(alpha g) / (exp(alpha g) + 1): equal to rounding; 3 ops as mul, sigmoid, mul).
        Past the threshold (alpha * g > 20) it returns g itself, where sigmoid is 1 in float32
        (1 - 2e-9) and exp would overflow (the gate is clamped to <= limit anyway)."""
        return torch.ops.aten.softplus_backward(g_AI, g_AI, self.alpha, _SOFTPLUS_THRESHOLD)

    def __call__(self, h_A2I: torch.Tensor) -> torch.Tensor:
        g, up = h_A2I.clamp(*self.bounds(h_A2I)).chunk(2, dim=-1)
        glu = self._glu(g)
        return torch.addcmul(glu, up, glu)  # (up + 1) * glu in one op

    def backward(
        self, g_AI: torch.Tensor, h_A2I: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # both clamps in one op, as the forward; the gradient passes where the clamp left the
        # input as it was (inside the bounds, inclusive: torch.clamp's rule), one mask for the
        # gate and the up half (~7 ops fewer than a mask per half)
        h_c = h_A2I.clamp(*self.bounds(h_A2I))
        g, up_c = h_c.chunk(2, dim=-1)
        glu = self._glu(g)
        # glu = silu(alpha g) / alpha, so d glu / d g = silu'(alpha g), and
        # d act / d g = g_act * (up + 1) * silu'(alpha g): silu_backward of g_act * (up + 1)
        # (one addcmul) at alpha * g (4 ops fewer than sigmoid's derivative spelt out)
        g_gate = torch.ops.aten.silu_backward(torch.addcmul(g_AI, g_AI, up_c), g * self.alpha)
        g_h = torch.cat((g_gate, g_AI * glu), dim=-1)
        return g_h.mul_(h_c == h_A2I), torch.addcmul(glu, up_c, glu)


_SOFTPLUS_THRESHOLD = 20.0
"""`ClampedSwiGLU._glu`'s softplus threshold (torch's default): beyond it the op returns its
grad (g), sigmoid(20) being 1 - 2e-9 (1 in float32, bfloat16 and float16)."""


Activation = SwiGLU | ClampedSwiGLU


def expert_activation(cfg: ModelConfig) -> Activation:
    """The activation `cfg.expert_activation` names."""
    if cfg.expert_activation == "clamped_swiglu":
        return ClampedSwiGLU(cfg.swiglu_alpha, cfg.swiglu_limit)
    return SwiGLU()
