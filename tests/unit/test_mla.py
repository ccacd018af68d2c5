"""Multi-head latent attention (model/mla.py) and FP8 block dequantisation (model/fp8.py)
against transformers' own DeepSeek-V3 attention and FP8 integration, on the same weights."""

from __future__ import annotations

import types

import pytest
import torch

from slipstream.model.attention import sdpa
from slipstream.model.fp8 import (
    block_size_from_hf,
    dequantize_fp8_block,
    dequantize_state_dict,
)
from slipstream.model.mla import MLAttention, mla_softmax_scale, yarn_mscale

transformers = pytest.importorskip("transformers")
from transformers.integrations import finegrained_fp8 as hf_fp8  # noqa: E402
from transformers.modeling_rope_utils import yarn_apply_mscale  # noqa: E402
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hfds  # noqa: E402

YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 0.9,
        "mscale_all_dim": 0.7, "original_max_position_embeddings": 64, "beta_fast": 32,
        "beta_slow": 1}  # fmt: skip


def _hf_config(q_lora_rank: int | None, rope: dict | None, interleave: bool, bias: bool):
    return transformers.DeepseekV3Config(
        vocab_size=64, hidden_size=48, num_attention_heads=4, num_key_value_heads=4,
        q_lora_rank=q_lora_rank, kv_lora_rank=16, qk_nope_head_dim=12, qk_rope_head_dim=8,
        head_dim=8, v_head_dim=10, max_position_embeddings=256, rope_interleave=interleave,
        rope_parameters=rope or {"rope_type": "default", "rope_theta": 10000.0},
        attention_bias=bias, num_hidden_layers=1, n_routed_experts=4, n_group=2, topk_group=1,
        num_experts_per_tok=2, first_k_dense_replace=1, moe_intermediate_size=8,
        intermediate_size=16,
    )  # fmt: skip


def _pair(q_lora_rank, rope, interleave, bias):
    cfg = _hf_config(q_lora_rank, rope, interleave, bias)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = hfds.DeepseekV3Attention(cfg, 0).eval()
    with torch.no_grad():
        for p in hf.parameters():  # biases and norm weights random too
            p.normal_(0, 0.3)
    factor = rope["factor"] if rope else None
    scale = mla_softmax_scale(20, factor, rope.get("mscale_all_dim", 0) if rope else 0)
    ours = MLAttention(48, 4, q_lora_rank, 16, 12, 8, 10, scale, interleave, 0, bias)
    ours.load_state_dict(hf.state_dict())
    rotary = hfds.DeepseekV3RotaryEmbedding(cfg)
    return ours, hf, rotary


@pytest.mark.parametrize(
    ("q_lora_rank", "rope", "interleave", "bias"),
    [(24, YARN, True, True), (None, YARN, True, False), (24, None, False, False)],
)
def test_mla_equals_transformers(q_lora_rank, rope, interleave, bias):
    ours, hf, rotary = _pair(q_lora_rank, rope, interleave, bias)
    x = torch.randn(2, 40, 48, generator=torch.Generator().manual_seed(1))
    pos = torch.arange(40)[None].expand(2, -1) + 100  # past original_max: YaRN's ramp matters
    cos_sin = rotary(x, pos)
    mask = torch.full((40, 40), -torch.inf).triu(1)[None, None]
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    out = ours(x1, cos_sin)
    ref, _ = hf(x2, cos_sin, mask)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    out.square().sum().backward()
    ref.square().sum().backward()
    torch.testing.assert_close(x1.grad, x2.grad, atol=1e-5, rtol=1e-5)
    hf_params = dict(hf.named_parameters())
    for name, p in ours.named_parameters():
        torch.testing.assert_close(p.grad, hf_params[name].grad, atol=1e-4, rtol=1e-5, msg=name)


def test_softmax_scale_equals_transformers_yarn_mscale():
    assert mla_softmax_scale(20, 4.0, 0.7) == pytest.approx(yarn_apply_mscale(YARN, 20**-0.5))
    assert mla_softmax_scale(20, None, 0.7) == 20**-0.5
    assert yarn_mscale(1.0, 5.0) == 1.0


class _ConcatCache:
    """A minimal KVCache: keys/values concatenated per layer, causal over absolute positions."""

    length = None

    def __init__(self) -> None:
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}

    def attend(self, layer_idx, q, k, v):
        self.k[layer_idx] = torch.cat((self.k[layer_idx], k), 2) if layer_idx in self.k else k
        self.v[layer_idx] = torch.cat((self.v[layer_idx], v), 2) if layer_idx in self.v else v
        S, T = self.k[layer_idx].shape[2], q.shape[2]
        mask = torch.ones(T, S, dtype=torch.bool).tril(S - T)
        return sdpa(q, self.k[layer_idx], self.v[layer_idx], mask_TS=mask)


def test_mla_through_a_cache_equals_the_full_forward():
    """Prefill then one token at a time through a KVCache (K 20 wide, V 10): the cache's
    1/sqrt(Dk) scale plus q's pre-scaling gives the YaRN-corrected MLA scale."""
    ours, _, rotary = _pair(24, YARN, True, False)
    x = torch.randn(1, 12, 48, generator=torch.Generator().manual_seed(2))
    pos = torch.arange(12)[None]
    with torch.no_grad():
        full = ours(x, rotary(x, pos))
        cache = _ConcatCache()
        parts = [ours(x[:, :8], rotary(x, pos[:, :8]), cache)]
        parts += [ours(x[:, t : t + 1], rotary(x, pos[:, t : t + 1]), cache) for t in range(8, 12)]
    torch.testing.assert_close(torch.cat(parts, 1), full, atol=1e-5, rtol=1e-5)


def _hf_quantize(w: torch.Tensor, block=(128, 128)):
    q = hf_fp8.Fp8Quantize.__new__(hf_fp8.Fp8Quantize)
    q.hf_quantizer = types.SimpleNamespace(
        quantization_config=types.SimpleNamespace(weight_block_size=list(block), scale_fmt=None)
    )
    out = q._quantize_one("x.weight", w)
    return out["x.weight"], out["x.weight_scale_inv"]


def test_fp8_block_dequantisation_equals_transformers():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(256, 384, generator=g) * torch.rand(256, 1, generator=g) * 10
    w_fp8, scale = _hf_quantize(w)
    assert w_fp8.dtype == torch.float8_e4m3fn and scale.shape == (2, 3)
    deq = hf_fp8.Fp8Dequantize.__new__(hf_fp8.Fp8Dequantize)
    theirs = deq._dequantize_one(w_fp8, scale, output_dtype=torch.float32)
    ours = dequantize_fp8_block(w_fp8, scale)
    assert torch.equal(ours, theirs)
    assert (ours - w).abs().max() < 0.07 * w.abs().max()  # it is a real quantisation
    # stacked experts (E, rows, cols) and E8M0 byte scales
    w3 = w_fp8.view(2, 128, 384)
    s3 = scale.view(2, 1, 3)
    assert torch.equal(dequantize_fp8_block(w3, s3), deq._dequantize_one(w3, s3, torch.float32))
    e8 = torch.randint(100, 140, (2, 3), dtype=torch.uint8, generator=g)
    assert torch.equal(
        dequantize_fp8_block(w_fp8, e8), deq._dequantize_one(w_fp8, e8, torch.float32)
    )


def test_fp8_ragged_blocks_equal_transformers_backward_dequant():
    """DeepSeek-V3's kv_a_proj_with_mqa is 576 x 7168: 4.5 blocks of rows, the last block's
    scale covers the remainder (transformers' _dequantize_fp8_weight)."""
    g = torch.Generator().manual_seed(4)
    w_fp8 = (torch.randn(200, 300, generator=g) * 50).to(torch.float8_e4m3fn)
    scale = torch.rand(2, 3, generator=g) + 0.1
    theirs = hf_fp8._dequantize_fp8_weight(w_fp8, scale, [128, 128], torch.float32)
    assert torch.equal(dequantize_fp8_block(w_fp8, scale), theirs)
    with pytest.raises(ValueError, match="scale grid"):
        dequantize_fp8_block(w_fp8, scale[:1])


def test_fp8_state_dict_and_config():
    g = torch.Generator().manual_seed(5)
    w_fp8, scale = _hf_quantize(torch.randn(128, 256, generator=g))
    norm = torch.ones(8)
    out = dequantize_state_dict(
        {"a.weight": w_fp8, "a.weight_scale_inv": scale, "n.weight": norm}, (128, 128)
    )
    assert set(out) == {"a.weight", "n.weight"} and out["a.weight"].dtype == torch.float32
    with pytest.raises(ValueError, match="b.weight is FP8 but has no b.weight_scale_inv"):
        dequantize_state_dict({"b.weight": w_fp8}, (128, 128))
    assert block_size_from_hf({"quantization_config": {"quant_method": "fp8",
                                "weight_block_size": [128, 128]}}) == (128, 128)  # fmt: skip
    assert block_size_from_hf({}) is None
    with pytest.raises(ValueError, match="quant_method='mxfp4'"):
        block_size_from_hf({"quantization_config": {"quant_method": "mxfp4"}})
