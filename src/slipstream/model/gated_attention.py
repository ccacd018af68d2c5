"""Gated full attention, the attention layer of Qwen3-Next / Qwen3.5 / Qwen3.6 (one in four
layers of the hybrid; the others are Gated DeltaNet, model/gated_deltanet.py).

Differences from the Qwen3 attention (model/layers.py): `q_proj` is twice as wide and holds, per
head, the query then an output gate of the same width; the attention output is multiplied by
sigmoid(gate) before `o_proj`; the per-head q/k norms are zero-centred (`1 + w`); RoPE rotates the
first `rotary_dim` dims of each head only (`partial_rotary_factor` 0.25: 64 of 256). Numerics
and parameter names as transformers' `Qwen3NextAttention` (tests/unit/test_gdn.py).

Shape legend: B batch, T tokens, D hidden, H query heads, K kv heads, Dh head width, R rotary
dims.
"""

from __future__ import annotations

import torch
from torch import nn

from slipstream.model.attention import KVCache, causal_attend
from slipstream.model.gated_deltanet import ZeroCenteredRMSNorm


def rope_partial(
    x_BHTD: torch.Tensor, cos_BTR: torch.Tensor, sin_BTR: torch.Tensor
) -> torch.Tensor:
    """Rotate-half RoPE on the first R = cos.shape[-1] dims of each head, the rest unchanged."""
    R = cos_BTR.shape[-1]
    rot, keep = x_BHTD[..., :R], x_BHTD[..., R:]
    r1, r2 = rot.chunk(2, dim=-1)
    rot = rot * cos_BTR[:, None] + torch.cat((-r2, r1), dim=-1) * sin_BTR[:, None]
    return torch.cat((rot, keep), dim=-1)


class GatedAttention(nn.Module):
    """Grouped-query attention with a per-head sigmoid output gate (see the module docstring)."""

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        eps: float,
        layer_idx: int,
        attention_bias: bool = False,
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_attention_heads={num_heads} not divisible by num_key_value_heads={num_kv_heads}"
            )
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.layer_idx = layer_idx
        bias = attention_bias
        self.q_proj = nn.Linear(hidden_size, 2 * num_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=bias)
        self.q_norm = ZeroCenteredRMSNorm(head_dim, eps)
        self.k_norm = ZeroCenteredRMSNorm(head_dim, eps)

    def forward(
        self,
        x_BTD: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        """(B, T, D) -> (B, T, D); cos/sin (B, T, R) for the rotated dims."""
        B, T, _ = x_BTD.shape
        H, K, Dh = self.num_heads, self.num_kv_heads, self.head_dim
        q_BTHD, gate_BTHD = self.q_proj(x_BTD).view(B, T, H, 2 * Dh).chunk(2, dim=-1)
        q_BHTD = self.q_norm(q_BTHD).transpose(1, 2)
        k_BKTD = self.k_norm(self.k_proj(x_BTD).view(B, T, K, Dh)).transpose(1, 2)
        v_BKTD = self.v_proj(x_BTD).view(B, T, K, Dh).transpose(1, 2)
        cos, sin = cos_sin
        q_BHTD, k_BKTD = rope_partial(q_BHTD, cos, sin), rope_partial(k_BKTD, cos, sin)
        if cache is None:
            out_BHTD = causal_attend(q_BHTD, k_BKTD, v_BKTD)
        else:
            out_BHTD = cache.attend(self.layer_idx, q_BHTD, k_BKTD, v_BKTD)
        out_BTHD = out_BHTD.transpose(1, 2) * torch.sigmoid(gate_BTHD)
        return self.o_proj(out_BTHD.reshape(B, T, H * Dh))
