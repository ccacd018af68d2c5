"""GPT-OSS beyond the family rows of test_families.py (logits, train step, round trip, R3, engine
greedy): MXFP4 checkpoints against transformers' own dequantisation, the engine on prompts longer
than several windows with prefix-cache hits, the CUDA-graph decode shape (full key span, padded
bucket) with sinks and windows, YaRN's frequencies, and the attention kernels' pieces."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file
from test_engine_ops import _prefilled_batch
from test_families import _hf_model

from slipstream.config.engine import EngineConfig
from slipstream.config.model import YarnRope
from slipstream.engine import GenerateRequest, NativeEngine, SamplingParams
from slipstream.engine.batch import RunningBatch
from slipstream.engine.decode import DecodeStep
from slipstream.engine.kv_cache import SlotKVCache
from slipstream.engine.routing import RoutingRecorder
from slipstream.model import MoEForCausalLM, load_pretrained, mxfp4, rope
from slipstream.model.attention_variants import variant_attend
from slipstream.model.families import family_for

transformers = pytest.importorskip("transformers")
torch.set_num_threads(1)


@pytest.fixture(scope="module")
def hf_pair(tmp_path_factory):
    hf = _hf_model("gpt_oss")
    directory = tmp_path_factory.mktemp("gpt_oss")
    hf.save_pretrained(directory)
    return hf, load_pretrained(directory)


def test_mxfp4_dequantisation_equals_transformers():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 10, 4, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(100, 150, (3, 10, 4), dtype=torch.uint8, generator=g)
    for dtype in (torch.float32, torch.bfloat16):
        ref = convert_moe_packed_tensors(blocks, scales, dtype=dtype)  # (E, in, out)
        assert torch.equal(mxfp4.dequantize(blocks, scales, dtype).transpose(1, 2), ref)
    with pytest.raises(ValueError, match="do not match scales"):
        mxfp4.dequantize(blocks, scales[:, :, :3])
    with pytest.raises(ValueError, match="has no .*_scales"):
        mxfp4.dequantize_state_dict({"x.down_proj_blocks": blocks})


def test_mxfp4_checkpoint_loads_as_transformers_dequantises_it(tmp_path):
    """A checkpoint whose experts are `*_blocks` / `*_scales` (as released): loaded, its experts
    equal transformers' dequantisation of the same bytes, and its logits those of transformers'
    model holding those weights."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    family = family_for("gpt_oss")
    hf_cfg = {**family.tiny_hf_config(), "intermediate_size": 32}  # in dims: multiples of 32
    hf_cfg.pop("model_type")
    torch.manual_seed(0)
    hf = transformers.GptOssForCausalLM(transformers.GptOssConfig(**hf_cfg)).float().eval()
    g = torch.Generator().manual_seed(1)
    sd = {}
    with torch.no_grad():
        for name, p in hf.named_parameters():
            base = 1.0 if name.endswith("norm.weight") else 0.0
            p.copy_(base + 0.2 * torch.randn(p.shape, generator=g))
            if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                sd[name] = p.detach().clone()
                continue
            E, n_in, n_out = p.shape
            blocks = torch.randint(0, 256, (E, n_out, n_in // 32, 16), dtype=torch.uint8,
                                   generator=g)  # fmt: skip
            scales = torch.randint(120, 126, (E, n_out, n_in // 32), dtype=torch.uint8,
                                   generator=g)  # fmt: skip
            sd[f"{name}_blocks"], sd[f"{name}_scales"] = blocks, scales
            p.copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
    save_file(sd, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads(hf.config.to_json_string())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    ours = load_pretrained(tmp_path)
    as_hf = family.weights.to_hf(ours.state_dict(), ours.config, True)
    for name, t in hf.state_dict().items():
        assert torch.equal(as_hf[name], t), name
    ids = torch.randint(0, hf_cfg["vocab_size"], (2, 13), generator=g)
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits_BTV, hf(ids).logits, atol=1e-5, rtol=1e-5)


def test_yarn_frequencies_equal_transformers():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    for head_dim in (8, 64):
        config = transformers.GptOssConfig(head_dim=head_dim, num_attention_heads=4,
                                           hidden_size=64)  # fmt: skip
        ref, scaling_ref = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
        yarn = YarnRope(factor=32, original_max_position_embeddings=4096, truncate=False)
        inv, scaling = rope.inv_freq(head_dim, 150000.0, yarn)
        assert torch.equal(inv, ref) and scaling == scaling_ref


def test_sink_and_window_attention_equal_the_eager_definition():
    """The zero-key + mask-column form of sinks (and the window mask) against transformers'
    eager form (cat the sink logit to the scores, softmax, drop it), gradients included."""
    g = torch.Generator().manual_seed(0)
    B, H, K, T, D, W = 2, 4, 2, 11, 8, 4
    q, k, v = (torch.randn(B, n, T, D, generator=g, requires_grad=True) for n in (H, K, K))
    sinks = torch.randn(H, generator=g, requires_grad=True)
    out = variant_attend(q, k, v, W, sinks)
    i, j = torch.arange(T)[:, None], torch.arange(T)[None]
    mask = torch.zeros(T, T).masked_fill(~((j <= i) & (j > i - W)), float("-inf"))
    scores = q @ k.repeat_interleave(H // K, 1).transpose(2, 3) / D**0.5 + mask
    full = torch.cat((scores, sinks.view(1, H, 1, 1).expand(B, H, T, 1)), dim=-1)
    ref = full.softmax(-1)[..., :-1] @ v.repeat_interleave(H // K, 1)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-5)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v, sinks))
    refs = torch.autograd.grad(ref.square().sum(), (q, k, v, sinks))
    for a, b in zip(grads, refs, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_engine_long_prompts_with_prefix_hits_equal_transformers_generate(hf_pair):
    """Prompts of 2-4 blocks (16 tokens each), 5-9 sliding windows long, sharing prefixes, in
    one mixed-length batch, twice: the second pass loads the shared blocks from the prefix
    cache (counted), and both equal transformers' greedy generate."""
    hf, ours = hf_pair
    V = ours.config.vocab_size
    g = torch.Generator().manual_seed(4)
    base = torch.randint(3, V, (40,), generator=g).tolist()
    prompts = [base[:33], base, base[:20] + [7, 8, 9], base[:36]]
    news = [5, 4, 6, 3]
    want, want_lp = [], []
    with torch.no_grad():
        for p, n in zip(prompts, news, strict=True):
            out = hf.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False,
                              output_logits=True, return_dict_in_generate=True)  # fmt: skip
            tokens = out.sequences[0, len(p) :]
            want.append(tokens.tolist())
            logits = torch.cat(out.logits).log_softmax(-1)
            want_lp.append(logits.gather(1, tokens[:, None])[:, 0])
    cfg = EngineConfig(kv_cache_tokens=4 * 64, max_seq_len=64, max_batch_size=4,
                       prefix_cache_tokens=256)  # fmt: skip
    with NativeEngine(ours, cfg) as engine:
        for _ in range(2):
            reqs = [GenerateRequest(p, SamplingParams(temperature=0, max_new_tokens=n))
                    for p, n in zip(prompts, news, strict=True)]  # fmt: skip
            got = {c.request_id: c for c in engine.generate(reqs)}
            assert [got[r.request_id].token_ids for r in reqs] == want
            for r, lp in zip(reqs, want_lp, strict=True):  # sinks and windows in every step
                torch.testing.assert_close(torch.tensor(got[r.request_id].logprobs), lp,
                                           atol=2e-5, rtol=0)  # fmt: skip
        assert engine.prefix_cache is not None and engine.prefix_cache.hit_tokens >= 3 * 16


def test_full_key_span_and_padded_bucket_equal_the_exact_step(hf_pair):
    """The CUDA-graph shape of a decode step (key span fixed at the slot length, the bucket
    padded with a free slot), run eagerly with sinks and a window: the live rows sample what the
    exact-size step samples."""
    _, ours = hf_pair
    model = ours
    prompts = [[5, 6, 7, 8, 9, 10], [9, 10, 11], [12, 13, 14, 15, 16]]
    params = SamplingParams(temperature=1.0, top_k=20, max_new_tokens=6, seed=3)
    with torch.inference_mode():
        exact = _prefilled_batch(model, prompts, params, slot_len=14)
        padded = _prefilled_batch(model, prompts, params, slot_len=14)
        big = SlotKVCache.for_model(model, 4, 14)
        big.k_LNKSD[:, :3] = padded.cache.k_LNKSD
        big.v_LNKSD[:, :3] = padded.cache.v_LNKSD
        wide = RunningBatch(big, model.config.vocab_size, "cpu")
        for i, row in enumerate(padded.rows):
            wide.add(row, len(prompts[i]))
        for name in ("pos_N", "gen_N", "last_N", "out_tok_NS", "out_lp_NS", "u_NS"):
            getattr(wide, name)[:3] = getattr(padded, name)[:3]
        ref = DecodeStep(model, exact, RoutingRecorder(model), cuda_graphs=False)
        step = DecodeStep(model, wide, RoutingRecorder(model), cuda_graphs=False)
        for _ in range(5):  # positions past the window of 4
            want = ref(3)
            step.reset_padding(3, 4)
            wide.params()
            got = step.device_step(4, big.slot_len - 1)
            wide.advance_host(3)
            tokens, logprobs, _ = got[:, :3].tolist()
            assert [int(t) for t in tokens] == want.tokens
            torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(want.logprobs),
                                       atol=1e-5, rtol=0)  # fmt: skip


def test_sink_columns_follow_in_place_weight_updates(hf_pair):
    """A hot-swap copies weights in place; DecodeStep.weights_updated refreshes the cache's
    cached sink columns in their storage (what a captured graph reads)."""
    _, ours = hf_pair
    model = MoEForCausalLM(ours.config).eval()
    model.load_state_dict(ours.state_dict())
    with torch.inference_mode():
        batch = _prefilled_batch(model, [[5, 6, 7]], SamplingParams(temperature=0), 8)
        step = DecodeStep(model, batch, RoutingRecorder(model), cuda_graphs=False)
        step(1)
        col = batch.cache._sink_cols[0][1]
        storage = col.data_ptr()
        sinks = model.model.layers[0].self_attn.sinks
        sinks.copy_(sinks + 1.0)
        step.weights_updated()
        assert col.data_ptr() == storage
        K = model.config.num_key_value_heads
        assert torch.equal(col[0, :, :, 0].reshape(-1), sinks.detach())
        assert K * col.shape[2] == sinks.shape[0]
