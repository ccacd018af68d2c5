"""The sinks' gradient (model/attention_variants.py `_SinkGradient`, from a second, no-grad
attention) on `sink_sdpa`'s path (any additive mask, the zero key padded here) against the
eager definition (cat the sink logit to the scores, softmax, drop it); `variant_attend`'s
cached-mask path is checked the same way in test_gpt_oss.py."""

from __future__ import annotations

import torch

from slipstream.model.attention_variants import additive, allowed_TS, sink_sdpa


def test_sink_sdpa_gradients_equal_the_eager_definition() -> None:
    g = torch.Generator().manual_seed(0)
    B, H, K, T, D, W = 2, 4, 2, 9, 8, 3
    q, k, v = (torch.randn(B, n, T, D, generator=g, requires_grad=True) for n in (H, K, K))
    sinks = torch.randn(H, generator=g, requires_grad=True)
    pos = torch.arange(T)
    mask_11TS = additive(allowed_TS(pos, pos, W), torch.float32)[None, None]
    out = sink_sdpa(q, k, v, mask_11TS, sinks)
    scores = q @ k.repeat_interleave(H // K, 1).transpose(2, 3) / D**0.5 + mask_11TS
    full = torch.cat((scores, sinks.view(1, H, 1, 1).expand(B, H, T, 1)), dim=-1)
    ref = full.softmax(-1)[..., :-1] @ v.repeat_interleave(H // K, 1)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-5)
    g_out = torch.randn(out.shape, generator=g)
    grads = torch.autograd.grad(out, (q, k, v, sinks), g_out)
    refs = torch.autograd.grad(ref, (q, k, v, sinks), g_out)
    for a, b in zip(grads, refs, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    assert grads[3].abs().min() > 0  # every head's sink gets a gradient
