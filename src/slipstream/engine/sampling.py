"""Batched sampling with per-row parameters and counter-based per-request randomness.

Every row of a decode step may have its own temperature, top-k, top-p, min-p and seed; one call
samples them all with a handful of tensor ops (no per-row Python loop).

Filtering follows SGLang's `top_k_top_p_min_p_sampling_from_probs_torch`: on the temperature-scaled
softmax p sorted in descending order, drop token i when the mass before it already exceeds top_p
(cum_i - p_i > top_p), when its rank >= top_k, or when p_i < min_p * p_max; the kept probabilities
are renormalised. `processed_logprobs` returns log of that renormalised distribution, so the
behaviour logprob of a sampled token is exactly what a trainer recomputes from the same logits and
parameters. Greedy rows (temperature 0) take the argmax and report its logprob under the raw
distribution (log_softmax of the logits), as SGLang's greedy sampler and vLLM's default
`logprobs_mode="raw_logprobs"` do (the trainer takes a greedy rollout's policy at temperature 1).

Top-n alternatives (`raw_top_logprobs`) are the model's raw distribution (log_softmax of the
logits: no temperature, no filters), as SGLang's `top_logprobs_num` and vLLM's default
`logprobs_mode="raw_logprobs"` define them, so a greedy or low-temperature request still sees
the n most likely tokens; the sampled token's own logprob stays the processed (behaviour) one.

Randomness: instead of a stateful torch.Generator per request, each draw is a pure function of
(seed, sample index, token index) through an integer hash, which gives the same guarantee (same
seed, same output, whatever the batch composition or arrival order) without a Python call per row.
One uniform u per row picks the token by inverse CDF over the processed distribution.

Everything here runs on the device without reading a value back (no host sync), so a decode step
that samples can be captured in a CUDA graph (`decode.py`); the host flags of `RowParams` that
pick a code path are fixed per batch composition.

Legend: B rows, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from slipstream.engine.base import ALL_TOKENS, SamplingParams

_M32 = 0xFFFFFFFF


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    """murmur3's 32-bit finaliser on int64 tensors holding values < 2**32 (products wrap mod 2**64,
    and only the low 32 bits are kept)."""
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _M32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _M32
    return h ^ (h >> 16)


def counter_uniform(
    seed_B: torch.Tensor, stream_B: torch.Tensor, step_B: torch.Tensor
) -> torch.Tensor:
    """A uniform float32 in (0, 1) per row, a pure function of (seed, stream, step) (int64 tensors)."""
    h = _fmix32((step_B + 0x632BE5AB) & _M32)
    h = _fmix32(h ^ ((stream_B * 0x9E3779B1) & _M32))
    h = _fmix32(h ^ (seed_B & _M32))
    h = _fmix32(h ^ ((seed_B >> 32) & _M32))
    # 23 bits so that (k + 0.5) / 2**23 < 1 exactly in float32.
    return ((h >> 9).to(torch.float32) + 0.5) / float(1 << 23)


@dataclass
class RowParams:
    """Per-row sampling parameters as tensors (built once per batch change, not per step).
    Build one for a trainer-side recomputation with `RowParams.build([params] * B, vocab_size)`."""

    temperature_B: torch.Tensor  # float32; greedy rows hold 1.0
    top_k_B: torch.Tensor  # int64; ALL_TOKENS -> V; greedy rows hold 1
    top_p_B: torch.Tensor  # float32
    min_p_B: torch.Tensor  # float32
    greedy_B: torch.Tensor  # bool
    all_greedy: bool
    any_greedy: bool
    needs_filter: bool  # any row with top-k/top-p/min-p filtering (else the sort is skipped)

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        vocab_size: int,
        device: torch.device | str = "cpu",
    ) -> RowParams:
        temps = [1.0 if p.greedy else p.temperature for p in params]
        top_ks = [
            1 if p.greedy else (vocab_size if p.top_k == ALL_TOKENS else p.top_k) for p in params
        ]
        greedy = [p.greedy for p in params]
        needs_filter = any(
            not p.greedy and (p.top_p < 1.0 or p.min_p > 0.0 or top_k < vocab_size)
            for p, top_k in zip(params, top_ks, strict=True)
        )

        def t(x: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(x, dtype=dtype, device=device)

        return cls(
            temperature_B=t(temps, torch.float32),
            top_k_B=t(top_ks, torch.int64),
            top_p_B=t([p.top_p for p in params], torch.float32),
            min_p_B=t([p.min_p for p in params], torch.float32),
            greedy_B=t(greedy, torch.bool),
            all_greedy=all(greedy),
            any_greedy=any(greedy),
            needs_filter=needs_filter,
        )


def processed_logprobs(logits_BV: torch.Tensor, rp: RowParams) -> torch.Tensor:
    """log of the distribution each row samples from (float32, -inf where filtered out)."""
    scaled_BV = logits_BV.float() / rp.temperature_B[:, None]
    if not rp.needs_filter and not rp.any_greedy:
        return torch.log_softmax(scaled_BV, dim=-1)
    sorted_BV, order_BV = scaled_BV.sort(dim=-1, descending=True)
    probs_BV = torch.softmax(sorted_BV, dim=-1)
    cum_BV = probs_BV.cumsum(dim=-1)
    rank_V = torch.arange(sorted_BV.shape[-1], device=sorted_BV.device)
    drop_BV = (cum_BV - probs_BV) > rp.top_p_B[:, None]
    drop_BV |= rank_V[None, :] >= rp.top_k_B[:, None]
    drop_BV |= probs_BV < (probs_BV[:, :1] * rp.min_p_B[:, None])
    drop_BV[:, 0] = False  # the most likely token always survives
    kept_lp_BV = torch.log_softmax(sorted_BV.masked_fill(drop_BV, float("-inf")), dim=-1)
    return torch.empty_like(kept_lp_BV).scatter_(1, order_BV, kept_lp_BV)


def sample(
    logits_BV: torch.Tensor,
    rp: RowParams,
    u_B: torch.Tensor,
    lp_BV: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row. Returns (token_ids_B int64, behaviour logprobs_B float32).

    `u_B` is each row's uniform for this token: counter_uniform(seed, sample index, token index),
    which the running batch precomputes for a whole sample when the row joins. `lp_BV`: the
    rows' `processed_logprobs`, when the caller computed them already (for top-n outputs)."""
    argmax_B = logits_BV.argmax(dim=-1)
    if rp.all_greedy:
        return argmax_B, _raw_logprob(logits_BV, argmax_B)
    if lp_BV is None:
        lp_BV = processed_logprobs(logits_BV, rp)
    cdf_BV = lp_BV.exp().cumsum(dim=-1)
    target_B1 = (u_B * cdf_BV[:, -1]).unsqueeze(1)
    token_B = torch.searchsorted(cdf_BV, target_B1, right=True).squeeze(1)
    token_B = token_B.clamp_(max=logits_BV.shape[-1] - 1)
    if rp.any_greedy:
        token_B = torch.where(rp.greedy_B, argmax_B, token_B)
    logprob_B = lp_BV.gather(1, token_B[:, None]).squeeze(1)
    # Rounding at the very top of the CDF can land on a filtered token: fall back to the argmax.
    # Applied unconditionally (a where per row) rather than after a test on the host, which
    # would be a host sync per step.
    bad_B = torch.isneginf(logprob_B)
    token_B = torch.where(bad_B, argmax_B, token_B)
    logprob_B = torch.where(bad_B, lp_BV.gather(1, argmax_B[:, None]).squeeze(1), logprob_B)
    if rp.any_greedy:
        logprob_B = torch.where(rp.greedy_B, _raw_logprob(logits_BV, argmax_B), logprob_B)
    return token_B, logprob_B


def _raw_logprob(logits_BV: torch.Tensor, token_B: torch.Tensor) -> torch.Tensor:
    """log p(token) under the model's raw distribution (log_softmax of the logits), float32: a
    greedy row's logprob, as SGLang's greedy sampler and vLLM's `raw_logprobs` report it (and
    what the trainer recomputes for a greedy rollout, whose policy it takes at temperature 1)."""
    logits_BV = logits_BV.float()
    chosen_B = logits_BV.gather(1, token_B[:, None]).squeeze(1)
    return chosen_B - torch.logsumexp(logits_BV, dim=-1)


def raw_top_logprobs(logits_BV: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The `width` most likely tokens of each row under the model's raw distribution
    (log_softmax of the logits, whatever the row's temperature and filters), best first:
    (ids [B, width] int64, logprobs [B, width] float32). Computed on the logits' device."""
    values_BW, ids_BW = torch.log_softmax(logits_BV.float(), dim=-1).topk(width, dim=-1)
    return ids_BW, values_BW
