"""Token log-probabilities (and entropies) from the final hidden states without materialising the
float32 (N, V) logits: the LM head and the log-softmax run over `chunk_tokens` rows at a time,
and backward recomputes each chunk's logits instead of keeping them.

    logp_N, ent_N = chunked_logprobs(h_ND, lm_head.weight, targets_N, chunk_tokens=4096,
                                     temperature=1.0, with_entropy=True)

Memory: one chunk's (C, V) logits in float32 (plus its softmax in backward) instead of the
whole batch's; at Qwen3's vocabulary (151,936) and 16 x 4,096 tokens the full float32 logits
alone are 40 GB, a 4,096-token chunk 2.5 GB. Compute: the LM head's matmul runs twice (forward
and the recompute in backward), which is what a fused/chunked cross-entropy costs everywhere.

Numerics: per row, logits z = h @ W^T / temperature in the compute dtype (autocast's when on,
else h's), then float32: logp = z[target] - logsumexp(z); entropy = logsumexp(z) - sum(p * z).
Gradients: dlogp/dz = onehot - p; dentropy/dz = -p * (log p + entropy).
"""

from __future__ import annotations

import torch


def chunked_logprobs(
    hidden_ND: torch.Tensor,
    weight_VD: torch.Tensor,
    targets_N: torch.Tensor,
    *,
    chunk_tokens: int,
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """-> (log p(target) per row (N,) float32, entropy per row (N,) float32 or None)."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens = {chunk_tokens}: must be >= 1")
    dtype = hidden_ND.dtype
    if torch.is_autocast_enabled(hidden_ND.device.type):
        dtype = torch.get_autocast_dtype(hidden_ND.device.type)
    logp_N, ent_N = _ChunkedLogprobs.apply(
        hidden_ND, weight_VD, targets_N, chunk_tokens, 1.0 / temperature, with_entropy, dtype
    )
    return logp_N, (ent_N if with_entropy else None)


def _cat(ts: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(ts)


def _logits(h_CD: torch.Tensor, w_VD: torch.Tensor, scale: float) -> torch.Tensor:
    z_CV = torch.mm(h_CD, w_VD.t()).float()
    return z_CV if scale == 1.0 else z_CV * scale


class _ChunkedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden_ND, weight_VD, targets_N, chunk, scale, with_entropy, dtype):  # type: ignore[override]
        h_ND, w_VD = hidden_ND.to(dtype), weight_VD.to(dtype)
        logps, lses, ents = [], [], []
        for lo in range(0, max(h_ND.shape[0], 1), chunk):  # static bounds: no host sync
            z_CV = _logits(h_ND[lo : lo + chunk], w_VD, scale)
            lse_C = torch.logsumexp(z_CV, dim=-1)
            lses.append(lse_C)
            logps.append(z_CV.gather(1, targets_N[lo : lo + chunk, None]).squeeze(1) - lse_C)
            if with_entropy:
                ents.append(lse_C - (torch.exp(z_CV - lse_C[:, None]) * z_CV).sum(-1))
        cat = _cat if len(lses) > 1 else (lambda ts: ts[0])
        logp_N, lse_N = cat(logps), cat(lses)
        ent_N = cat(ents) if with_entropy else logp_N.new_zeros(0)
        ctx.save_for_backward(h_ND, w_VD, targets_N, lse_N, ent_N)
        ctx.meta = (chunk, scale, with_entropy, hidden_ND.dtype, weight_VD.dtype)
        return logp_N, ent_N

    @staticmethod
    def backward(ctx, g_logp_N, g_ent_N):  # type: ignore[override]
        h_ND, w_VD, targets_N, lse_N, ent_N = ctx.saved_tensors
        chunk, scale, with_entropy, h_dtype, w_dtype = ctx.meta
        N = h_ND.shape[0]
        g_hs: list[torch.Tensor] = []
        g_w_VD = None
        for lo in range(0, max(N, 1), chunk):  # (one empty chunk when N = 0)
            hi = min(lo + chunk, N)
            h_CD = h_ND[lo:hi]
            z_CV = _logits(h_CD, w_VD, scale)
            logp_CV = z_CV - lse_N[lo:hi, None]
            p_CV = torch.exp(logp_CV)
            # d logp(target)/dz = onehot - p, weighted by the incoming gradient
            g_z_CV = p_CV * (-g_logp_N[lo:hi, None])
            g_z_CV.scatter_add_(1, targets_N[lo:hi, None], g_logp_N[lo:hi, None])
            if with_entropy:
                # d entropy/dz = -p * (log p + entropy)
                g_z_CV -= g_ent_N[lo:hi, None] * p_CV * (logp_CV + ent_N[lo:hi, None])
            if scale != 1.0:
                g_z_CV *= scale
            g_z_CV = g_z_CV.to(h_ND.dtype)
            if ctx.needs_input_grad[0]:
                g_hs.append(torch.mm(g_z_CV, w_VD))
            if ctx.needs_input_grad[1]:
                g_w = torch.mm(g_z_CV.t(), h_CD).float()
                g_w_VD = g_w if g_w_VD is None else g_w_VD.add_(g_w)
        g_h_ND = (_cat(g_hs) if len(g_hs) > 1 else g_hs[0]) if g_hs else None
        return (
            None if g_h_ND is None else g_h_ND.to(h_dtype),
            None if g_w_VD is None else g_w_VD.to(w_dtype),
            None, None, None, None, None,
        )  # fmt: skip
