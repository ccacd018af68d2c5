"""Attention with learned sinks and sliding windows (GPT-OSS), on the SDPA kernels.

A **sink** is a learned logit per query head, an extra softmax column whose probability is
dropped: out = sum_j softmax([s_1..s_S, sink])_j v_j over the S real keys only. Here it is one
more key with k = 0 and v = 0 (its score q.0 = 0) and an additive mask column holding the sink
logit: SDPA then normalises over the real keys and the sink together and the sink's value adds
nothing, exactly the definition, on any SDPA kernel that takes a float mask (gradients reach the
sink through the mask; checked against transformers' eager `cat([scores, sinks])` form in
tests/unit/test_gpt_oss.py). The engine's `SlotKVCache` keeps that zero key in its storage, in
front of position 0, so decode reads it with the other keys and copies nothing.

A **sliding window** W lets a query at position i see keys at positions j with i - W < j <= i
(W keys, itself included: transformers' `sliding_window_overlay`).

Shape legend as model/attention.py: B batch, H query heads, K kv heads, T queries, S keys, D head
width; S1 = S + 1 (the sink key first).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from slipstream.model.attention import sdpa

_MASKS: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
"""`variant_attend`'s additive (1, 1, T, T) masks (with sinks (1, 1, T, 1 + T): the sink key's
column first, 0) and, with sinks, the (1, 1, 1, 1 + T) one-hot of that column, by (T, window,
sinks, device, dtype): every layer of
a forward (and later forwards of the same length) reuses one instead of ~10 ops per layer
(training is per-op overhead bound on a GPU). A few entries at most (cleared past
`_MAX_MASKS`)."""
_MAX_MASKS = 8


def allowed_TS(q_pos_T: torch.Tensor, k_pos_S: torch.Tensor, window: int | None) -> torch.Tensor:
    """bool (T, S) (or broadcast of the inputs' leading dims): key j visible from query i, causal
    and, with `window`, within the last `window` positions."""
    q = q_pos_T[..., :, None]
    k = k_pos_S[..., None, :]
    ok = k <= q
    if window is not None:
        ok = ok & (k > q - window)
    return ok


def additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bool "may attend" mask as SDPA's additive float mask (0 / -inf): two ops (-inf, then 0
    where allowed; zeros, a negated mask and a fill took three)."""
    return torch.full(
        allowed.shape, float("-inf"), dtype=dtype, device=allowed.device
    ).masked_fill_(allowed, 0.0)


def with_sink_column(mask_BHTS: torch.Tensor, sinks_H: torch.Tensor) -> torch.Tensor:
    """The additive mask (broadcastable to (B, H, T, S)) with the sink logits as a first column:
    (B, H, T, S1), heads in q's order."""
    B, _, T, S = mask_BHTS.shape
    H = sinks_H.shape[0]
    sink_BHT1 = sinks_H.to(mask_BHTS.dtype).view(1, H, 1, 1).expand(B, H, T, 1)
    return torch.cat((sink_BHT1, mask_BHTS.expand(B, H, T, S)), dim=-1)


def zero_key_first(x_BKSD: torch.Tensor) -> torch.Tensor:
    """k or v with the sink's zero key in front: (B, K, S1, D) (one pad op, not zeros + cat)."""
    return F.pad(x_BKSD, (0, 0, 1, 0))


class _SinkGradient(torch.autograd.Function):
    """y as it is, with the sinks' gradient d loss / d s_h = sum g * (-p_sink * y) over the
    batch, queries and head dims (the sink's value is zero: dy/ds_h = -p_sink * y), given
    `npy` = -p_sink * y. One op forward and two backward, where the equivalent zero-valued
    autograd term (s - s.detach()) * -(p_sink * y) took ~10."""

    @staticmethod
    def forward(ctx, y_BHTD: torch.Tensor, sinks_H: torch.Tensor, npy_BHTD: torch.Tensor):  # type: ignore[override]
        ctx.save_for_backward(npy_BHTD)
        return y_BHTD.view_as(y_BHTD)

    @staticmethod
    def backward(ctx, g_BHTD: torch.Tensor):  # type: ignore[override]
        (npy_BHTD,) = ctx.saved_tensors
        g_sinks_H = None
        if ctx.needs_input_grad[1]:
            g_sinks_H = (g_BHTD * npy_BHTD).sum((0, 2, 3))
        return g_BHTD, g_sinks_H, None


def sink_sdpa(
    q_BHTD: torch.Tensor,
    k_BKSD: torch.Tensor,
    v_BKSD: torch.Tensor,
    mask_BHTS: torch.Tensor,
    sinks_H: torch.Tensor | None,
) -> torch.Tensor:
    """Attention under an additive float mask (broadcastable to (B, H, T, S)), with sinks when
    given (the zero key and the sink column are added here)."""
    if sinks_H is None:
        return sdpa(q_BHTD, k_BKSD, v_BKSD, mask_TS=mask_BHTS)
    real_BKSD = v_BKSD
    k_BKSD, v_BKSD = zero_key_first(k_BKSD), zero_key_first(v_BKSD)
    if not (torch.is_grad_enabled() and sinks_H.requires_grad):
        return sdpa(q_BHTD, k_BKSD, v_BKSD, mask_TS=with_sink_column(mask_BHTS, sinks_H))
    # Training: a mask that needs a gradient sends SDPA to its math kernel (the (T, S) scores
    # materialised, ~80 ops per call with backward). Instead the sinks enter the mask detached
    # (fused kernels) and their gradient comes from dy/ds_h = -p_sink * y (the sink's value is
    # zero), p_sink = 1 - (attention of the same mask over values one for every real key and
    # zero for the sink), added as a term
    # that is zero in value: (s - s.detach()) * -(p_sink * y).detach().
    # (`_SinkGradient`: the term as an autograd Function, fewer ops)
    mask = with_sink_column(mask_BHTS, sinks_H.detach())
    y = sdpa(q_BHTD, k_BKSD, v_BKSD, mask_TS=mask)
    with torch.no_grad():
        ones = zero_key_first(torch.ones(real_BKSD.shape, dtype=y.dtype, device=y.device))
        minus_p_sink = sdpa(q_BHTD, k_BKSD, ones, mask_TS=mask)[..., :1] - 1
        npy = minus_p_sink * y
    return _SinkGradient.apply(y, sinks_H, npy)


def _sink_values(like_BKSD: torch.Tensor) -> torch.Tensor:
    """Values -1 at the sink key and zero at the real keys, in the shape of `like_BKSD`: the
    attention of these is minus the sink's probability, in every head dim (so it multiplies y
    as it is: no slice, no negation). One entry, the current forward's shape (its layers share
    it), made outside inference mode and autograd."""
    key = (like_BKSD.shape, like_BKSD.dtype, like_BKSD.device)
    values = _SINK_VALUES.get(key)
    if values is None:
        _SINK_VALUES.clear()
        with torch.inference_mode(False), torch.no_grad():
            B, K, S, D = like_BKSD.shape  # -1 at position 0, padded with zeros: two ops
            minus_ones = torch.full((B, K, 1, D), -1.0, dtype=like_BKSD.dtype,
                                    device=like_BKSD.device)  # fmt: skip
            values = F.pad(minus_ones, (0, 0, 0, S - 1))
        _SINK_VALUES[key] = values
    return values


_SINK_VALUES: dict[tuple, torch.Tensor] = {}
"""`_sink_values`' one tensor by (shape, dtype, device)."""


def _sink_attend(
    q_BHTD: torch.Tensor,
    k_BKTD: torch.Tensor,
    v_BKTD: torch.Tensor,
    mask_11TS1: torch.Tensor,
    first_11S1: torch.Tensor,
    sinks_H: torch.Tensor,
    sink_key_first: bool = False,
) -> torch.Tensor:
    """`sink_sdpa` over `variant_attend`'s cached mask, which has the sink column already (0
    there; `sink_key_first`: k and v hold the zero key already), with fewer ops: the sinks enter column 0 by one addcmul with the cached one-hot
    `first_11S1` (m + s * onehot: s in column 0, m + 0 = m elsewhere, exact), made without
    autograd (no detach op; the sinks' gradient comes from `_SinkGradient` as in `sink_sdpa`),
    and minus the sink's probability is the attention of the cached `_sink_values` (-1 at the
    sink key; exactly the negation of +1's), not that of ones at the real keys less 1."""
    H = sinks_H.shape[0]
    k_BKSD, v_BKSD = k_BKTD, v_BKTD
    if not sink_key_first:
        k_BKSD, v_BKSD = zero_key_first(k_BKTD), zero_key_first(v_BKTD)
    with torch.no_grad():
        sink_1H11 = sinks_H.to(mask_11TS1.dtype).view(1, H, 1, 1)
        mask_1HTS = torch.addcmul(mask_11TS1, sink_1H11, first_11S1)
    y = sdpa(q_BHTD, k_BKSD, v_BKSD, mask_TS=mask_1HTS)
    if not (torch.is_grad_enabled() and sinks_H.requires_grad):
        return y
    with torch.no_grad():
        # (B, H, T, D), every head dim -p_sink
        minus_p_sink = sdpa(q_BHTD, k_BKSD, _sink_values(v_BKSD), mask_TS=mask_1HTS)
        npy = minus_p_sink * y
    return _SinkGradient.apply(y, sinks_H, npy)


def variant_attend(
    q_BHTD: torch.Tensor,
    k_BKTD: torch.Tensor,
    v_BKTD: torch.Tensor,
    window: int | None,
    sinks_H: torch.Tensor | None,
    sink_key_first: bool = False,
) -> torch.Tensor:
    """Causal self-attention over the given tokens only (the no-cache path, as
    `causal_attend`), within `window` and with `sinks_H` when given; plain causal SDPA when
    neither is. `sink_key_first` (with sinks): position 0 of q, k and v is the sink's zero key
    (and a zero query, which sees the sink key only; its output is to be dropped), the tokens
    follow: (B, H, 1 + T, D) in and out."""
    T = q_BHTD.shape[2]
    if window is None and sinks_H is None:
        return sdpa(q_BHTD, k_BKTD, v_BKTD, is_causal=T > 1)
    sinks = sinks_H is not None
    first_key = sinks and sink_key_first
    key = (T, window, sinks, first_key, q_BHTD.device, q_BHTD.dtype)
    cached = _MASKS.get(key)
    if cached is None:
        # made outside inference mode: a training forward may save it for backward
        # (a cold step makes them: in its count, so few ops, no scalar assignments)
        with torch.inference_mode(False), torch.no_grad():
            n = T - first_key  # the tokens
            dtype, device = q_BHTD.dtype, q_BHTD.device
            pos_T = torch.arange(T, device=device)
            allowed = allowed_TS(pos_T, pos_T, window)
            if first_key:
                # position 0 is the zero query and the sink key, the tokens 1..n: causal among
                # them, the zero query sees the sink key only (no later key); every token sees
                # the sink key, which a window may leave out
                if window is not None:
                    allowed.select(1, 0).fill_(True)
            elif sinks:  # the sink key's column first, visible from every query
                allowed = F.pad(allowed, (1, 0), value=True)
            if sinks:  # (1, 1, 1, 1 + n): 1 at the sink key's column
                first = F.pad(torch.ones((1, 1, 1, 1), dtype=dtype, device=device), (0, n))
            else:  # unused
                first = allowed.new_zeros(0)
            mask = torch.full((1, 1, *allowed.shape), float("-inf"), dtype=dtype, device=device)
            cached = (mask.masked_fill_(allowed, 0.0), first)
        if len(_MASKS) >= _MAX_MASKS:
            _MASKS.clear()
        _MASKS[key] = cached
    mask_11TS, first_11S1 = cached
    if sinks_H is None:
        return sdpa(q_BHTD, k_BKTD, v_BKTD, mask_TS=mask_11TS)
    return _sink_attend(q_BHTD, k_BKTD, v_BKTD, mask_11TS, first_11S1, sinks_H, first_key)
