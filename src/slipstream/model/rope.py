"""RoPE frequencies: plain and YaRN, as transformers computes them (`modeling_rope_utils`:
`_compute_default_rope_parameters`, `_compute_yarn_parameters`), so the cos/sin tables match its
to the last bit in float32.

YaRN (GPT-OSS: factor 32, original context 4096, beta_fast 32, beta_slow 1, truncate False,
theta 150000): frequencies that turn more than beta_fast times over the original context are
kept, those that turn fewer than beta_slow times are divided by `factor`, a linear ramp between;
cos and sin are multiplied by `attention_factor` (default 0.1 ln(factor) + 1).
"""

from __future__ import annotations

import math

import torch

from slipstream.config.model import YarnRope


def inv_freq(
    rotary_dim: int, theta: float, yarn: YarnRope | None, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, float]:
    """(inverse frequencies (rotary_dim / 2,) float32, the cos/sin multiplier)."""
    pos_freqs = theta ** (
        torch.arange(0, rotary_dim, 2, dtype=torch.int64, device=device).float() / rotary_dim
    )
    if yarn is None:
        return 1.0 / pos_freqs, 1.0
    factor = yarn.factor
    scaling = yarn.attention_factor
    if scaling is None:
        scaling = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0

    def correction_dim(rotations: float) -> float:
        return (
            rotary_dim * math.log(yarn.original_max_position_embeddings / (rotations * 2 * math.pi))
        ) / (2 * math.log(theta))

    low, high = correction_dim(yarn.beta_fast), correction_dim(yarn.beta_slow)
    if yarn.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = (1 - ramp).to(device)
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv, float(scaling)


def cos_sin(
    position_ids_BT: torch.Tensor, inv_freq_d: torch.Tensor, scaling: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables (B, T, 2d) for the given positions, computed in float32 (times `scaling`
    when it is not 1), cast to `dtype`; the layout of model/layers.py's `rope_cos_sin`."""
    freqs_BTd = position_ids_BT.float()[..., None] * inv_freq_d.to(position_ids_BT.device)
    emb_BTD = torch.cat((freqs_BTd, freqs_BTd), dim=-1)
    cos, sin = emb_BTD.cos(), emb_BTD.sin()
    if scaling != 1.0:
        cos, sin = cos * scaling, sin * scaling
    return cos.to(dtype), sin.to(dtype)
