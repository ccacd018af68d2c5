"""The attention/KV-cache seam and the attention kernels caches build on. The one cache
implementation is the engine's `SlotKVCache` (engine/kv_cache.py).

Shape legend: B batch, T new tokens this call, S past+new key length, H query heads, K key/value
heads (not expanded to H), D head width.

Contract (`KVCache.attend`): each attention layer computes q, k, v for the *new* tokens (after the
per-head q/k RMSNorm and RoPE) and hands them to `cache.attend(layer_idx, q_BHTD, k_BKTD, v_BKTD)`,
which stores k/v however it likes, decides which past keys each new query may see (masking) and
returns the attention output `out_BHTD` (softmax scale 1/sqrt(D), same dtype as q). Layers are
called in order 0..num_layers-1 once per forward. The model never reads cache state except
`length`, where the default position ids start when the caller passes none
(`MoEForCausalLM.default_position_ids`).

Attention variants (model/attention_variants.py) pass two keywords, which a cache must honour:
`window` (a sliding-window layer: a query at position i sees keys at positions (i - window, i])
and `sinks_H` (per query head learned sink logits, (H,): an extra softmax column whose
probability is dropped). Plain layers pass neither (None).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F

# enable_gqa arrived in torch 2.5; older torch gets an explicit repeat of the K/V heads.
_SDPA_HAS_GQA = tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 5)


@runtime_checkable
class KVCache(Protocol):
    """What the model needs from a cache: one call per layer per forward. Implementations own
    storage, masking and bookkeeping (e.g. per-row lengths or pages in the inference engine)."""

    @property
    def length(self) -> int | torch.Tensor | None:
        """Positions already cached before this forward: an int (every row), a per-row (B,)
        tensor, or None when the cache does not track them (its callers always pass position
        ids, as the engine does with its `SlotKVCache`; default positions then start at 0)."""
        ...

    def attend(
        self,
        layer_idx: int,
        q_BHTD: torch.Tensor,
        k_BKTD: torch.Tensor,
        v_BKTD: torch.Tensor,
        *,
        window: int | None = None,
        sinks_H: torch.Tensor | None = None,
    ) -> torch.Tensor: ...


def sdpa(
    q_BHTD: torch.Tensor,
    k_BKSD: torch.Tensor,
    v_BKSD: torch.Tensor,
    *,
    is_causal: bool = False,
    mask_TS: torch.Tensor | None = None,
) -> torch.Tensor:
    """scaled_dot_product_attention with grouped-query heads (K divides H). `mask_TS` is a bool
    "may attend" mask broadcast over batch and heads (or any shape SDPA accepts)."""
    num_heads, num_kv = q_BHTD.shape[1], k_BKSD.shape[1]
    if num_heads % num_kv:
        raise ValueError(f"query heads {num_heads} not divisible by kv heads {num_kv}")
    if num_kv != num_heads and not _SDPA_HAS_GQA:
        rep = num_heads // num_kv
        k_BKSD = k_BKSD.repeat_interleave(rep, dim=1)
        v_BKSD = v_BKSD.repeat_interleave(rep, dim=1)
    kwargs = {"enable_gqa": True} if (num_kv != num_heads and _SDPA_HAS_GQA) else {}
    return F.scaled_dot_product_attention(
        q_BHTD, k_BKSD, v_BKSD, attn_mask=mask_TS, is_causal=is_causal, **kwargs
    )


def causal_attend(q_BHTD: torch.Tensor, k_BKTD: torch.Tensor, v_BKTD: torch.Tensor) -> torch.Tensor:
    """Plain causal self-attention over the given tokens only (the no-cache path)."""
    return sdpa(q_BHTD, k_BKTD, v_BKTD, is_causal=q_BHTD.shape[2] > 1)
