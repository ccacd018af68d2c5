"""The MoE policy model on its own: expert paths, KV cache, router losses, checkpoints, dtypes."""

import json
import math

import pytest
import torch

from cacheutil import decode_rows, extend_rows
from slipstream.engine.kv_cache import SlotKVCache
from slipstream.model import (
    KVCache,
    ModelConfig,
    MoEForCausalLM,
    causal_attend,
    hf_config_from_model_config,
    load_balancing_loss,
    load_pretrained,
    model_config_from_hf,
    router_z_loss,
    save_pretrained,
)
from slipstream.model.converters import (
    ActivationCheckpointing,
    ExpertPath,
    apply_converters,
    model_converters,
)
from slipstream.model.moe_block import SparseMoeBlock

VOCAB = 40


def _model(**kw) -> MoEForCausalLM:
    torch.manual_seed(0)
    base = dict(vocab_size=VOCAB, hidden_size=64, head_dim=16, mlp_only_layers=[1])
    return MoEForCausalLM(ModelConfig(**{**base, **kw})).eval()


def _ids(batch: int = 2, seq: int = 12) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("impl", ["loop", "grouped_mm"])
@pytest.mark.parametrize(("experts", "top_k"), [(8, 2), (16, 4), (4, 4)])
def test_expert_paths_agree_forward_and_backward(impl, experts, top_k):
    torch.manual_seed(0)
    block = SparseMoeBlock(64, experts, top_k, 32, norm_topk_prob=top_k > 2, impl="grouped")
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.1)
    x = torch.randn(3, 20, 64, requires_grad=True)
    g = torch.randn(3, 20, 64)

    def run(which: str):
        block.impl = which
        x.grad = None
        block.zero_grad()
        out, logits = block(x)
        (out * g).sum().backward()
        return out.detach(), x.grad.clone(), [p.grad.clone() for p in block.parameters()]

    ref_out, ref_gx, ref_gp = run("grouped")
    out, gx, gp = run(impl)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(gx, ref_gx, atol=1e-5, rtol=1e-5)
    for a, b in zip(gp, ref_gp, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_the_config_and_the_expert_paths_are_one_list():
    from typing import get_args

    from slipstream.config.model import MOE_IMPLS

    assert MOE_IMPLS == get_args(ModelConfig.model_fields["moe_impl"].annotation)
    for impl in MOE_IMPLS:  # every configurable path builds and converts
        SparseMoeBlock(16, 4, 1, 8, norm_topk_prob=True, impl=impl)
        ExpertPath(impl)
    for bad in ("batched", "static"):  # internal paths are no choice of the config
        with pytest.raises(ValueError, match="moe_impl"):
            ModelConfig(moe_impl=bad)
        with pytest.raises(ValueError, match="moe_impl"):
            ExpertPath(bad)  # type: ignore[arg-type]


def test_model_converters_follow_the_config():
    from slipstream.config.rl import TrainerConfig

    assert model_converters() == [ExpertPath("grouped")]
    tc = TrainerConfig(activation_checkpointing=True)
    assert model_converters("loop", tc) == [ExpertPath("loop"), ActivationCheckpointing()]
    with pytest.raises(ValueError, match="compile_blocks"):
        model_converters(trainer=TrainerConfig(compile_blocks=True), device="cpu")
    with pytest.raises(ValueError, match="converter"):  # no build reads moe_impl: not silently
        load_pretrained("unused", moe_impl="loop")


def test_unused_experts_and_bad_impl():
    block = SparseMoeBlock(16, 4, 1, 8, norm_topk_prob=True)
    torch.nn.init.normal_(block.experts.gate_up_proj)
    torch.nn.init.normal_(block.experts.down_proj)
    with torch.no_grad():
        block.gate.weight.zero_()
        block.gate.weight[2] = 1.0  # positive inputs all go to expert 2
    x = torch.rand(1, 5, 16) + 0.1
    out_grouped, _ = block(x)
    block.impl = "loop"
    torch.testing.assert_close(block(x)[0], out_grouped)
    with pytest.raises(ValueError, match="moe_impl"):
        SparseMoeBlock(16, 4, 1, 8, norm_topk_prob=True, impl="fast")


def test_incremental_decoding_matches_full_forward():
    model = _model()
    ids = _ids(seq=14)
    with torch.no_grad():
        full = model(ids).logits_BTV
        cache = SlotKVCache.for_model(model, num_slots=2, slot_len=32)
        steps = [extend_rows(model, cache, ids[:, :5], start=0)]
        steps.append(extend_rows(model, cache, ids[:, 5:9], start=5))  # chunk after a prefix
        for t in range(9, 14):
            steps.append(decode_rows(model, cache, ids[:, t : t + 1], pos=t))
    assert cache.k_LNKSD[:, :2, :, :14].abs().sum(-1).gt(0).all()  # 14 positions stored
    assert cache.k_LNKSD[:, :2, :, 14:].abs().sum() == 0
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)
    # back to a 9-token prefix: positions are given per call, so 9 and 10 are simply rewritten
    with torch.no_grad():
        redo = extend_rows(model, cache, ids[:, 9:11], start=9)
    torch.testing.assert_close(redo, full[:, 9:11], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="overflow"):
        extend_rows(model, cache, _ids(seq=40)[:, :30], start=9)


class _RecordingCache:
    """A minimal third-party cache: no storage, records what the model hands over."""

    length = None  # positions not tracked: default position ids start at 0

    def __init__(self) -> None:
        self.calls: list[tuple[int, tuple[int, ...], tuple[int, ...]]] = []

    def attend(self, layer_idx, q_BHTD, k_BKTD, v_BKTD):
        self.calls.append((layer_idx, tuple(q_BHTD.shape), tuple(k_BKTD.shape)))
        return causal_attend(q_BHTD, k_BKTD, v_BKTD)


def test_cache_protocol_seam():
    model = _model(num_attention_heads=4, num_key_value_heads=2)
    cache = _RecordingCache()
    assert isinstance(cache, KVCache)
    ids = _ids(seq=6)
    with torch.no_grad():
        out = model(ids, cache=cache).logits_BTV
        torch.testing.assert_close(out, model(ids).logits_BTV)
    assert cache.calls == [(i, (2, 4, 6, 16), (2, 2, 6, 16)) for i in range(4)]


def test_default_positions_follow_cache_length():
    model = _model()

    class _Len:
        length = torch.tensor([0, 3])

    pos = model.default_position_ids(2, 2, _Len(), torch.device("cpu"))
    assert pos.tolist() == [[0, 1], [3, 4]]
    assert model.default_position_ids(1, 3, None, torch.device("cpu")).tolist() == [[0, 1, 2]]


def test_load_balancing_and_z_loss_hand_computed():
    ln3 = math.log(3.0)
    spread = torch.tensor([[ln3, 0.0], [0.0, ln3]])  # probs .75/.25 and .25/.75, argmax 0 and 1
    same = torch.tensor([[ln3, 0.0], [ln3, 0.0]])  # both tokens pick expert 0
    # E * sum_e frac_e * meanprob_e
    assert load_balancing_loss([spread], 2, 1).item() == pytest.approx(2 * (0.5 * 0.5 * 2))
    assert load_balancing_loss([same], 2, 1).item() == pytest.approx(2 * (1.0 * 0.75))
    # layers are pooled (HF): spread + same -> frac (.75,.25), meanprob (.625,.375)
    pooled = 2 * (0.75 * 0.625 + 0.25 * 0.375)
    assert load_balancing_loss([spread, same], 2, 1).item() == pytest.approx(pooled)
    masked = load_balancing_loss([spread], 2, 1, token_mask_N=torch.tensor([True, False]))
    assert masked.item() == pytest.approx(2 * 0.75)
    assert router_z_loss([spread]).item() == pytest.approx(math.log(4.0) ** 2)
    assert router_z_loss([torch.zeros(3, 8)]).item() == pytest.approx(math.log(8.0) ** 2)


def test_model_aux_loss_combines_coefficients():
    model = _model(router_aux_loss_coef=0.01, router_z_loss_coef=0.001)
    out = model(_ids())
    cfg = model.config
    assert len(out.router_logits) == 3  # layers 0, 2, 3 (1 is dense)
    lb = load_balancing_loss(out.router_logits, cfg.num_experts, cfg.num_experts_per_tok)
    z = router_z_loss(out.router_logits)
    torch.testing.assert_close(out.aux_loss, 0.01 * lb + 0.001 * z)
    torch.testing.assert_close(out.load_balance_loss, lb.detach())
    out.aux_loss.backward()
    assert model.model.layers[0].mlp.gate.weight.grad.abs().sum() > 0


def test_sharded_save_load_round_trip(tmp_path):
    model = _model(shared_expert_intermediate_size=24, tie_word_embeddings=True)
    names = dict(model.named_parameters())
    assert "model.layers.0.mlp.shared_expert.up_proj.weight" in names
    assert "model.layers.0.mlp.shared_expert_gate.weight" in names
    save_pretrained(model, tmp_path, max_shard_bytes=64 * 1024)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 1 and all((tmp_path / s).is_file() for s in shards)
    assert "model.layers.0.mlp.experts.7.down_proj.weight" in index["weight_map"]
    assert "lm_head.weight" not in index["weight_map"]  # tied
    loaded = load_pretrained(tmp_path)
    assert loaded.config.shared_expert_intermediate_size == 24
    ids = _ids()
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits_BTV, model(ids).logits_BTV)
    # a second, unsharded save into the same directory replaces the shards
    save_pretrained(loaded, tmp_path)
    assert not (tmp_path / "model.safetensors.index.json").exists()
    assert sorted(p.name for p in tmp_path.glob("*.safetensors")) == ["model.safetensors"]


def test_bf16_forward_and_backward():
    model = _model().to(torch.bfloat16)
    ids = _ids()
    out = model(ids)
    assert out.logits_BTV.dtype == torch.float32
    assert torch.isfinite(out.logits_BTV).all()
    ref = _model()(ids).logits_BTV
    assert (out.logits_BTV - ref).abs().max() < 0.1
    (out.logits_BTV.logsumexp(-1).mean() + out.aux_loss).backward()
    assert model.model.embed_tokens.weight.grad.dtype == torch.bfloat16


def test_gradient_checkpointing_same_grads():
    model = _model().train()
    ids = _ids()
    model(ids).logits_BTV.square().mean().backward()
    ref = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model.gradient_checkpointing = True
    model(ids).logits_BTV.square().mean().backward()
    for a, b in zip(model.parameters(), ref, strict=True):
        torch.testing.assert_close(a.grad, b)


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="vocab_size"):
        MoEForCausalLM(ModelConfig())
    with pytest.raises(ValueError, match="num_key_value_heads"):
        MoEForCausalLM(ModelConfig(vocab_size=8, num_attention_heads=4, num_key_value_heads=3))


def test_logits_to_keep_and_config_not_mutated():
    cfg = ModelConfig(vocab_size=VOCAB, hidden_size=64, head_dim=16)
    model = apply_converters(MoEForCausalLM(cfg).eval(), model_converters("loop"))
    assert cfg.moe_impl == "grouped" and model.config == cfg  # converted, config untouched
    assert {b.impl for b in model.modules() if isinstance(b, SparseMoeBlock)} == {"loop"}
    ids = _ids()
    with torch.no_grad():
        full = model(ids).logits_BTV
        last = model(ids, logits_to_keep=3).logits_BTV
    assert last.shape == (2, 3, VOCAB)
    torch.testing.assert_close(last, full[:, -3:])


QWEN3_30B_A3B_CONFIG = {  # config.json of the Hub checkpoint (transformers 4.51 era)
    "architectures": ["Qwen3MoeForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "decoder_sparse_step": 1,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 6144,
    "max_position_embeddings": 40960,
    "max_window_layers": 48,
    "mlp_only_layers": [],
    "model_type": "qwen3_moe",
    "moe_intermediate_size": 768,
    "norm_topk_prob": True,
    "num_attention_heads": 32,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 48,
    "num_key_value_heads": 4,
    "output_router_logits": False,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.001,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}


def test_hub_config_maps_and_sizes_match_published_counts():
    cfg = model_config_from_hf(QWEN3_30B_A3B_CONFIG)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.rope_theta) == (128, 8, 1e6)
    with torch.device("meta"):
        model = MoEForCausalLM(cfg)
    # published: 30.5B total, 3.3B activated
    assert model.num_parameters() / 1e9 == pytest.approx(30.5, abs=0.1)
    assert model.num_parameters(active=True) / 1e9 == pytest.approx(3.3, abs=0.1)
    hf = hf_config_from_model_config(cfg, torch.bfloat16)
    assert model_config_from_hf(hf) == cfg
    with pytest.raises(ValueError, match="rope"):
        model_config_from_hf({**QWEN3_30B_A3B_CONFIG, "rope_scaling": {"rope_type": "yarn"}})
    with pytest.raises(ValueError, match="model_type"):
        model_config_from_hf({**QWEN3_30B_A3B_CONFIG, "model_type": "llama"})


@pytest.mark.parametrize("impl", ["grouped", "loop"])
def test_moe_block_accepts_zero_tokens(impl):
    # an expert-parallel rank can receive no tokens at all; the block must return (0, D), not raise
    block = SparseMoeBlock(16, 4, 2, 8, True, 0, impl)
    out = block.experts(torch.zeros(0, 16), torch.zeros(0, 2, dtype=torch.long), torch.zeros(0, 2))
    assert out.shape == (0, 16)


@pytest.mark.parametrize("shared", [0, 32])
@pytest.mark.parametrize("replay", [False, True])
def test_skip_padding_equals_the_padded_forward_on_real_tokens(shared: int, replay: bool) -> None:
    """Right-padded batch: running every per-token layer on the real tokens only changes
    nothing at the real positions (logits, router losses over them, and every gradient, with and
    without routing replay); the padding's logits and router logits are 0."""
    model = _model(shared_expert_intermediate_size=shared, router_z_loss_coef=0.01).train()
    ids = _ids(3, 9)
    real = torch.ones(3, 9, dtype=torch.bool)
    real[1, 5:] = False
    real[2, 2:] = False
    L, k = len(model.moe_layer_ids), model.config.num_experts_per_tok
    gen = torch.Generator().manual_seed(3)
    routing = torch.stack([torch.randperm(model.config.num_experts, generator=gen)[:k]
                           for _ in range(L * 27)]).view(L, 27, k) if replay else None  # fmt: skip

    def run(skip: bool):
        model.zero_grad(set_to_none=True)
        out = model(ids, token_mask_BT=real, replay_routing_LNk=routing,
                    skip_padding_BT=real if skip else None)  # fmt: skip
        loss = (out.logits_BTV.logsumexp(-1) * real).sum() + out.aux_loss
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return out, grads

    ref, ref_g = run(False)
    got, got_g = run(True)
    torch.testing.assert_close(got.logits_BTV[real], ref.logits_BTV[real], atol=1e-6, rtol=1e-5)
    assert torch.count_nonzero(got.logits_BTV[~real]) == 0
    torch.testing.assert_close(got.aux_loss, ref.aux_loss, atol=1e-7, rtol=1e-6)
    assert ref_g.keys() == got_g.keys()
    for name in ref_g:
        torch.testing.assert_close(got_g[name], ref_g[name], atol=1e-6, rtol=1e-5, msg=name)
    for got_NE, ref_NE in zip(got.router_logits, ref.router_logits, strict=True):
        assert got_NE.shape == ref_NE.shape
        assert torch.count_nonzero(got_NE[~real.reshape(-1)]) == 0
        torch.testing.assert_close(got_NE[real.reshape(-1)], ref_NE[real.reshape(-1)])


def test_skip_padding_refuses_what_it_cannot_compute_exactly() -> None:
    """A real token after padding (not right-padded), a cache or logits_to_keep: refused."""
    model = _model().train()
    ids = _ids(2, 6)
    holes = torch.ones(2, 6, dtype=torch.bool)
    holes[0, 2] = False
    with pytest.raises(ValueError, match="prefix"):
        model(ids, skip_padding_BT=holes)
    with pytest.raises(ValueError, match="bool"):
        model(ids, skip_padding_BT=holes.long())
    with pytest.raises(ValueError, match="training"):
        model(ids, skip_padding_BT=torch.ones(2, 6, dtype=torch.bool), logits_to_keep=1)
