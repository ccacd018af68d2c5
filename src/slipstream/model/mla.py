"""Multi-head latent attention (DeepSeek-V2/V3, Kimi K2, Moonlight, GLM-4.7-Flash), in plain
torch, numerics as transformers' `DeepseekV3Attention`.

q: a plain `q_proj` (q_lora_rank None) or the low-rank `q_a_proj -> q_a_layernorm -> q_b_proj`,
per head `qk_nope_head_dim + qk_rope_head_dim` wide. kv: `kv_a_proj_with_mqa` gives a latent of
`kv_lora_rank` (normed by `kv_a_layernorm`, expanded per head by `kv_b_proj` into the no-rope key
part and V of `v_head_dim`) plus one rope key of `qk_rope_head_dim` shared by all heads. K is
`qk_nope + qk_rope` wide and V `v_head_dim`: K and V widths differ. RoPE acts on the rope dims
only, on (even, odd) pairs when `rope_interleave` (DeepSeek's released layout), else rotate-half.
The softmax scale is 1/sqrt(qk_nope + qk_rope), times mscale(factor, mscale_all_dim)^2 under YaRN
(`mla_softmax_scale`); the YaRN cos/sin tables (with their own attention factor) come from the
model's RoPE, as for every other attention.

With a `KVCache` the layer hands the cache the expanded K and V (H heads each; V narrower than
K) and q pre-multiplied so that the cache's 1/sqrt(Dk) scale gives the MLA scale: a cache serving
MLA layers must accept V of another width than K. Caching the compressed latent instead (576
values per token for DeepSeek-V3 instead of 2 * 128 * 192) is the engine's choice, not made here.

Shape legend: B batch, T tokens, D hidden, H heads, R rope dims, P no-rope dims, Dv value width,
C kv_lora_rank.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from slipstream.model.attention import KVCache
from slipstream.model.layers import RMSNorm


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's 0.1 * mscale * ln(factor) + 1 (1 for factor <= 1), the paper's Eq. 21."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def mla_softmax_scale(qk_head_dim: int, yarn_factor: float | None, mscale_all_dim: float) -> float:
    """1/sqrt(qk_head_dim), times yarn_mscale(factor, mscale_all_dim)^2 when YaRN is on and
    `mscale_all_dim` is set (DeepSeek's reference scales the whole q.k, not only the rope dims,
    as transformers' `yarn_apply_mscale`)."""
    scale = qk_head_dim**-0.5
    if yarn_factor is not None and mscale_all_dim:
        scale *= yarn_mscale(yarn_factor, mscale_all_dim) ** 2
    return scale


def rope_interleaved(
    x_BHTR: torch.Tensor, cos_BTR: torch.Tensor, sin_BTR: torch.Tensor
) -> torch.Tensor:
    """RoPE on (even, odd) pairs; cos/sin are the usual cat(freqs, freqs) tables, whose first
    half holds the per-pair angle. The output holds the rotated evens then the rotated odds
    (transformers' layout: a fixed permutation of the dims, the same for q and k, so q.k is that
    of the interleaved rotation)."""
    half = cos_BTR.shape[-1] // 2
    cos, sin = cos_BTR[:, None, :, :half], sin_BTR[:, None, :, :half]
    x1, x2 = x_BHTR[..., 0::2], x_BHTR[..., 1::2]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def rope_half(x_BHTR: torch.Tensor, cos_BTR: torch.Tensor, sin_BTR: torch.Tensor) -> torch.Tensor:
    x1, x2 = x_BHTR.chunk(2, dim=-1)
    return x_BHTR * cos_BTR[:, None] + torch.cat((-x2, x1), dim=-1) * sin_BTR[:, None]


class MLAttention(nn.Module):
    """Multi-head latent attention; parameter names as transformers' DeepSeek-V3."""

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        q_lora_rank: int | None,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        softmax_scale: float,
        rope_interleave: bool,
        layer_idx: int,
        attention_bias: bool = False,
        lora_norm_eps: float = 1e-6,
    ) -> None:
        """`lora_norm_eps`: the q_a/kv_a norms' epsilon (transformers builds them with its 1e-6
        default, not `rms_norm_eps`)."""
        super().__init__()
        self.num_heads, self.q_lora_rank, self.kv_lora_rank = num_heads, q_lora_rank, kv_lora_rank
        self.qk_nope_head_dim, self.qk_rope_head_dim = qk_nope_head_dim, qk_rope_head_dim
        self.qk_head_dim = qk_nope_head_dim + qk_rope_head_dim
        self.v_head_dim, self.softmax_scale = v_head_dim, softmax_scale
        self.rope_interleave, self.layer_idx = rope_interleave, layer_idx
        q_out = num_heads * self.qk_head_dim
        self.q_proj: nn.Linear | None = None
        self.q_a_proj: nn.Linear | None = None
        self.q_a_layernorm: RMSNorm | None = None
        self.q_b_proj: nn.Linear | None = None
        if q_lora_rank is None:
            self.q_proj = nn.Linear(hidden_size, q_out, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden_size, q_lora_rank, bias=attention_bias)
            self.q_a_layernorm = RMSNorm(q_lora_rank, lora_norm_eps)
            self.q_b_proj = nn.Linear(q_lora_rank, q_out, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(
            hidden_size, kv_lora_rank + qk_rope_head_dim, bias=attention_bias
        )
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, lora_norm_eps)
        self.kv_b_proj = nn.Linear(
            kv_lora_rank, num_heads * (qk_nope_head_dim + v_head_dim), bias=False
        )
        self.o_proj = nn.Linear(num_heads * v_head_dim, hidden_size, bias=attention_bias)

    def forward(
        self,
        x_BTD: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        """(B, T, D) -> (B, T, D); cos/sin (B, T, R) for the rope dims."""
        B, T, _ = x_BTD.shape
        H, P, R, Dv = self.num_heads, self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim
        if self.q_proj is not None:
            q = self.q_proj(x_BTD)
        else:
            assert self.q_a_proj is not None and self.q_a_layernorm and self.q_b_proj is not None
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x_BTD)))
        q_pass_BHTP, q_rot_BHTR = q.view(B, T, H, P + R).transpose(1, 2).split((P, R), dim=-1)
        latent_BTC, k_rot_BTR = self.kv_a_proj_with_mqa(x_BTD).split((self.kv_lora_rank, R), -1)
        kv_BTHX = self.kv_b_proj(self.kv_a_layernorm(latent_BTC)).view(B, T, H, P + Dv)
        k_pass_BHTP, v_BHTV = kv_BTHX.transpose(1, 2).split((P, Dv), dim=-1)
        rope = rope_interleaved if self.rope_interleave else rope_half
        cos, sin = cos_sin
        q_rot_BHTR = rope(q_rot_BHTR, cos, sin)
        k_rot_B1TR = rope(k_rot_BTR[:, None], cos, sin)
        q_BHTK = torch.cat((q_pass_BHTP, q_rot_BHTR), dim=-1)
        k_BHTK = torch.cat((k_pass_BHTP, k_rot_B1TR.expand(B, H, T, R)), dim=-1)
        if cache is None:
            out_BHTV = F.scaled_dot_product_attention(
                q_BHTK, k_BHTK, v_BHTV, is_causal=T > 1, scale=self.softmax_scale
            )
        else:  # the cache scales by 1/sqrt(K): fold the MLA scale into q
            q_BHTK = q_BHTK * (self.softmax_scale * math.sqrt(self.qk_head_dim))
            out_BHTV = cache.attend(self.layer_idx, q_BHTK, k_BHTK, v_BHTV)
        return self.o_proj(out_BHTV.transpose(1, 2).reshape(B, T, H * Dv))
