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


_INV_FREQ: dict[tuple, tuple[torch.Tensor, float]] = {}
"""`inv_freq_cached`'s tables by (rotary_dim, theta, yarn, device)."""


def inv_freq_cached(
    rotary_dim: int, theta: float, yarn: YarnRope | None, device: torch.device
) -> tuple[torch.Tensor, float]:
    """`inv_freq`, computed once per (rotary_dim, theta, yarn, device) and shared (read only):
    a constant of the config, which every forward would otherwise recompute (~20 ops for YaRN;
    decode is per-op overhead bound). Made outside inference mode and autograd, so any forward
    may use it."""
    key = (rotary_dim, theta, None if yarn is None else yarn.model_dump_json(), str(device))
    hit = _INV_FREQ.get(key)
    if hit is None:
        with torch.inference_mode(False), torch.no_grad():
            hit = _INV_FREQ[key] = inv_freq(rotary_dim, theta, yarn, device)
    return hit


def cos_sin(
    position_ids_BT: torch.Tensor, inv_freq_d: torch.Tensor, scaling: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables (B, T, 2d) for the given positions, computed in float32 (times `scaling`
    when it is not 1), cast to `dtype`; the layout of model/layers.py's `rope_cos_sin`."""
    if inv_freq_d.device != position_ids_BT.device:
        inv_freq_d = inv_freq_d.to(position_ids_BT.device)
    freqs_BTd = position_ids_BT.float()[..., None] * inv_freq_d
    emb_BTD = torch.cat((freqs_BTd, freqs_BTd), dim=-1)
    cos, sin = emb_BTD.cos(), emb_BTD.sin()
    if scaling != 1.0:
        cos, sin = cos * scaling, sin * scaling
    if cos.dtype == dtype:  # no no-op casts (each one is a dispatched op)
        return cos, sin
    return cos.to(dtype), sin.to(dtype)
