"""The hybrid and latent-attention families (qwen3_next, qwen3_5_moe_text, qwen3_5_moe,
deepseek_v3): config.json and checkpoint maps against transformers' own save_pretrained output,
both ways, and FP8 block dequantisation against transformers' FP8 loader."""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from slipstream.config.model import ModelConfig
from slipstream.model.families import deepseek_v3, qwen3_5_moe, qwen3_next
from slipstream.model.gated_deltanet import split_qwen3_next_projections

transformers = pytest.importorskip("transformers")
# the modeling modules load lazily: once here, at collection, not in the first test
_ = (
    transformers.Qwen3NextForCausalLM,
    transformers.Qwen3_5MoeForCausalLM,
    transformers.Qwen3_5MoeForConditionalGeneration,
    transformers.DeepseekV3ForCausalLM,
)


def _hf_model(cls, cfg_cls, hf: dict, seed: int = 0):
    cfg = cfg_cls(**{k: v for k, v in hf.items() if k not in ("model_type", "architectures")})
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    with torch.no_grad():  # norms, biases, A_log, dt_bias: random too
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.1)
    return model


def _saved(model, tmp_path: Path, name: str) -> tuple[Path, dict[str, torch.Tensor], dict]:
    d = tmp_path / name
    model.save_pretrained(d)
    return d, load_file(d / "model.safetensors"), json.loads((d / "config.json").read_text())


def _cfg(family, hf_json: dict) -> ModelConfig:
    return ModelConfig(model_type=family.model_type, **family.config_from_hf(hf_json))


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k


def _in_memory(model) -> dict[str, torch.Tensor]:
    return {k: v.detach() for k, v in model.state_dict().items()}


def test_qwen3_next_checkpoint_both_ways(tmp_path):
    hf_json = qwen3_next.tiny_hf_config()
    model = _hf_model(transformers.Qwen3NextForCausalLM, transformers.Qwen3NextConfig, hf_json)
    _, disk, saved_json = _saved(model, tmp_path, "next")
    cfg = _cfg(qwen3_next.QWEN3_NEXT, saved_json)
    assert cfg.layer_types[3] == "full_attention" and cfg.linear_num_value_heads == 4
    assert cfg.partial_rotary_factor == 0.25 and cfg.mlp_only_layers == [1]
    mtp = {"mtp.fc.weight": torch.randn(4, 4)}
    weights = qwen3_next.QWEN3_NEXT.weights
    internal, passthrough = weights.from_hf({**disk, **mtp}, cfg)
    assert set(passthrough) == set(mtp)
    # internal names: transformers' in-memory names, GDN projections split (Qwen3.5's names)
    expected = _in_memory(model)
    for name in [k for k in expected if k.endswith("in_proj_qkvz.weight")]:
        prefix = name.removesuffix("in_proj_qkvz.weight")
        parts = split_qwen3_next_projections(
            expected.pop(name), expected.pop(prefix + "in_proj_ba.weight"), 2, 4, 8, 6
        )
        expected.update({f"{prefix}{p}.weight": t for p, t in parts.items()})
    _assert_same(internal, expected)
    _assert_same(weights.to_hf(internal, cfg, False), disk)
    _assert_same(weights.to_hf(internal, cfg, True), _in_memory(model))
    # config.json back: transformers reads the same architecture
    back = transformers.Qwen3NextConfig(**qwen3_next.config_to_hf(cfg))
    for key in ("layer_types", "linear_num_key_heads", "linear_value_head_dim", "mlp_only_layers",
                "shared_expert_intermediate_size", "head_dim", "num_key_value_heads"):  # fmt: skip
        assert getattr(back, key) == getattr(model.config, key), key
    assert back.rope_parameters["partial_rotary_factor"] == 0.25


def test_qwen3_5_moe_text_and_released_layouts(tmp_path):
    hf_json = qwen3_5_moe.tiny_hf_config()
    text = _hf_model(transformers.Qwen3_5MoeForCausalLM, transformers.Qwen3_5MoeTextConfig, hf_json)
    _, disk, saved_json = _saved(text, tmp_path, "text")
    assert saved_json["model_type"] == "qwen3_5_moe_text"
    cfg = _cfg(qwen3_5_moe.QWEN3_5_MOE_TEXT, saved_json)
    weights = qwen3_5_moe.QWEN3_5_MOE_TEXT.weights
    internal, _ = weights.from_hf(disk, cfg)
    _assert_same(internal, _in_memory(text))  # split projections: the model's own names
    _assert_same(weights.to_hf(internal, cfg, False), disk)
    back = transformers.Qwen3_5MoeTextConfig(**qwen3_5_moe.config_to_hf(cfg))
    assert back.layer_types == text.config.layer_types

    # a released checkpoint: the language model under model.language_model, a vision tower
    mm_json = qwen3_5_moe.tiny_multimodal_hf_config()
    mm_cfg = transformers.Qwen3_5MoeConfig(
        text_config=mm_json["text_config"], vision_config=mm_json["vision_config"]
    )
    torch.manual_seed(1)
    mm = transformers.Qwen3_5MoeForConditionalGeneration(mm_cfg).eval()
    _, mm_disk, mm_saved = _saved(mm, tmp_path, "mm")
    assert any(k.startswith("model.visual.") for k in mm_disk)
    assert mm_saved["model_type"] == "qwen3_5_moe"
    cfg_mm = _cfg(qwen3_5_moe.QWEN3_5_MOE, mm_saved)
    assert cfg_mm.model_dump(exclude={"model_type"}) == cfg.model_dump(exclude={"model_type"})
    mm_internal, _ = qwen3_5_moe.QWEN3_5_MOE.weights.from_hf(mm_disk, cfg_mm)
    lm = {"model." + k: v for k, v in _in_memory(mm.model.language_model).items()}
    _assert_same(mm_internal, {**lm, "lm_head.weight": mm.lm_head.weight.detach()})
    # saved back in the text layout, which transformers' Qwen3_5MoeForCausalLM loads
    out_json = qwen3_5_moe.QWEN3_5_MOE.config_to_hf(cfg_mm)
    assert out_json["model_type"] == "qwen3_5_moe_text"
    d = tmp_path / "mm_as_text"
    d.mkdir()
    save_file(
        {k: v.contiguous() for k, v in qwen3_5_moe.QWEN3_5_MOE.weights.to_hf(mm_internal, cfg_mm,
                                                                              False).items()},
        d / "model.safetensors", metadata={"format": "pt"},
    )  # fmt: skip
    (d / "config.json").write_text(json.dumps(out_json))
    reloaded = transformers.Qwen3_5MoeForCausalLM.from_pretrained(d).eval()
    ids = torch.randint(0, 96, (1, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = mm(input_ids=ids).logits
        torch.testing.assert_close(reloaded(input_ids=ids).logits, ref, atol=1e-5, rtol=1e-5)


class _DictSource:
    def __init__(self, sd: dict[str, torch.Tensor]) -> None:
        self.sd = sd

    def has(self, name: str) -> bool:
        return name in self.sd

    def slice(self, name: str, lo, hi):  # type: ignore[no-untyped-def]
        return self.sd[name][lo:hi]


def test_expert_parallel_rows_read_through_the_maps(tmp_path):
    """`rows` (what sharded expert-parallel loading reads): experts lo..hi-1 and the split GDN
    projections, equal to the full load's."""
    hf_json = qwen3_next.tiny_hf_config()
    model = _hf_model(transformers.Qwen3NextForCausalLM, transformers.Qwen3NextConfig, hf_json)
    _, disk, saved_json = _saved(model, tmp_path, "next")
    cfg = _cfg(qwen3_next.QWEN3_NEXT, saved_json)
    weights = qwen3_next.QWEN3_NEXT.weights
    internal, _ = weights.from_hf(disk, cfg)
    src = _DictSource(disk)
    for name in ("model.layers.0.mlp.experts.gate_up_proj", "model.layers.2.mlp.experts.down_proj",
                 "model.layers.0.linear_attn.in_proj_z.weight",
                 "model.layers.2.linear_attn.in_proj_qkv.weight"):  # fmt: skip
        assert torch.equal(weights.rows(src, name, 2, 5, cfg), internal[name][2:5]), name


def _hf_quantize(sd: dict[str, torch.Tensor], block: list[int]) -> dict[str, torch.Tensor]:
    from transformers.integrations import finegrained_fp8 as hf_fp8

    q = hf_fp8.Fp8Quantize.__new__(hf_fp8.Fp8Quantize)
    q.hf_quantizer = types.SimpleNamespace(
        quantization_config=types.SimpleNamespace(weight_block_size=block, scale_fmt=None)
    )
    out: dict[str, torch.Tensor] = {}
    for k, v in sd.items():  # as the releases: linear weights, not norms, embeddings, router
        if (
            k.endswith(".weight")
            and v.ndim == 2
            and not any(s in k for s in ("norm", "embed", "lm_head", ".gate."))
        ):
            out.update(q._quantize_one(k, v))
        else:
            out[k] = v
    return out


@pytest.mark.parametrize("q_lora_rank", [24, None])
def test_deepseek_v3_checkpoint_both_ways_and_fp8_equal_to_transformers(tmp_path, q_lora_rank):
    hf_json = {**deepseek_v3.tiny_hf_config(), "q_lora_rank": q_lora_rank}
    model = _hf_model(transformers.DeepseekV3ForCausalLM, transformers.DeepseekV3Config, hf_json)
    d, disk, saved_json = _saved(model, tmp_path, "ds")
    cfg = _cfg(deepseek_v3.DEEPSEEK_V3, saved_json)
    assert cfg.head_dim == 8 and cfg.n_group == 4 and cfg.mlp_only_layers == [0]
    assert cfg.rope_scaling is not None and cfg.rope_scaling.mscale_all_dim == 0.7
    weights = deepseek_v3.DEEPSEEK_V3.weights
    mtp = {"model.layers.3.eh_proj.weight": torch.randn(4, 8)}  # an MTP layer (layer L)
    internal, passthrough = weights.from_hf({**disk, **mtp}, cfg)
    assert set(passthrough) == set(mtp)
    _assert_same(internal, _in_memory(model))
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in internal
    _assert_same(weights.to_hf(internal, cfg, False), disk)
    back = transformers.DeepseekV3Config(**deepseek_v3.config_to_hf(cfg))
    for key in ("q_lora_rank", "kv_lora_rank", "qk_rope_head_dim", "v_head_dim", "n_group",
                "topk_group", "first_k_dense_replace", "n_shared_experts", "head_dim",
                "routed_scaling_factor", "rope_interleave"):  # fmt: skip
        assert getattr(back, key) == getattr(model.config, key), key
    for key in (
        "rope_type",
        "factor",
        "mscale",
        "mscale_all_dim",
        "original_max_position_embeddings",
    ):
        assert back.rope_parameters[key] == model.config.rope_parameters[key], key

    # FP8 with block scales: transformers' own quantiser writes it, its loader dequantises it
    block = [16, 16]  # the tiny shapes are not multiples of 128; the releases use 128
    fp8 = _hf_quantize(disk, block)
    assert sum(k.endswith("weight_scale_inv") for k in fp8) > 20
    q_dir = tmp_path / "ds_fp8"
    q_dir.mkdir()
    save_file(fp8, q_dir / "model.safetensors", metadata={"format": "pt"})
    q_json = {**saved_json, "quantization_config": {"quant_method": "fp8",
              "weight_block_size": block, "activation_scheme": "dynamic"}}  # fmt: skip
    (q_dir / "config.json").write_text(json.dumps(q_json))
    theirs = transformers.DeepseekV3ForCausalLM.from_pretrained(
        q_dir,
        quantization_config=transformers.FineGrainedFP8Config(
            dequantize=True, weight_block_size=block
        ),
    )
    ours, _ = weights.from_hf(fp8, _cfg(deepseek_v3.DEEPSEEK_V3, q_json))
    _assert_same(ours, _in_memory(theirs))
    q_cfg = _cfg(deepseek_v3.DEEPSEEK_V3, q_json)
    for name in ("model.layers.1.mlp.experts.gate_up_proj", "model.layers.2.mlp.experts.down_proj",
                 "model.layers.1.self_attn.kv_b_proj.weight"):  # fmt: skip
        rows = weights.rows(_DictSource(fp8), name, 2, 5, q_cfg)  # expert-parallel loading
        assert torch.equal(rows, ours[name][2:5]), name
    from slipstream.model import load_pretrained  # the whole load path: config, read, map

    ids = torch.randint(0, 96, (1, 20), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(
            load_pretrained(q_dir)(ids).logits_BTV, theirs.eval()(ids).logits, atol=1e-5, rtol=1e-5
        )
    # loaded in bfloat16: dequantised in float32 from the stored FP8 values and float32 scales,
    # then rounded once, as transformers does (a scale rounded to bfloat16 first is off by up
    # to 0.4%)
    ours_bf16 = load_pretrained(q_dir, dtype=torch.bfloat16).state_dict()
    theirs_bf16 = transformers.DeepseekV3ForCausalLM.from_pretrained(
        q_dir,
        dtype=torch.bfloat16,
        quantization_config=transformers.FineGrainedFP8Config(
            dequantize=True, weight_block_size=block
        ),
    )
    theirs_bf16 = _in_memory(theirs_bf16)
    for key in [k.removesuffix("_scale_inv") for k in fp8 if k.endswith("_scale_inv")]:
        name = key if key in theirs_bf16 else None
        if name is None:  # a per-expert tensor: compared stacked below
            continue
        assert theirs_bf16[name].dtype == torch.bfloat16
        assert torch.equal(ours_bf16[name], theirs_bf16[name]), name
    for name in [k for k in theirs_bf16 if k.endswith("experts.gate_up_proj")]:
        assert torch.equal(ours_bf16[name], theirs_bf16[name]), name
    changed = [k for k in ours if not torch.equal(ours[k], internal[k])]
    assert len(changed) > 10  # a real quantisation: the dequantised weights differ
    assert all(torch.allclose(ours[k], internal[k], atol=0.05, rtol=0.07) for k in ours)
    with pytest.raises(ValueError, match="quant_method='bitsandbytes'"):
        deepseek_v3.config_from_hf({**saved_json, "quantization_config": {"quant_method":
                                                                           "bitsandbytes"}})  # fmt: skip


def test_deepseek_v3_refuses_what_mla_cannot_express():
    hf = deepseek_v3.tiny_hf_config()
    with pytest.raises(ValueError, match="num_key_value_heads=2 must equal"):
        deepseek_v3.config_from_hf({**hf, "num_key_value_heads": 2})
    with pytest.raises(ValueError, match="rope_type='linear'"):
        deepseek_v3.config_from_hf({**hf, "rope_parameters": {"rope_type": "linear",
                                                              "factor": 2.0}})  # fmt: skip


# ---- the whole model against transformers ---------------------------------------------------

MODEL_CASES = {
    "qwen3_next": (qwen3_next.tiny_hf_config(), 150),  # T crosses GDN chunks at 64 and 128
    "qwen3_5_moe_text": (qwen3_5_moe.tiny_hf_config(), 150),
    "deepseek_v3": (deepseek_v3.tiny_hf_config(), 90),  # past YaRN's original 64 positions
    "deepseek_v3_q_proj": ({**deepseek_v3.tiny_hf_config(), "q_lora_rank": None}, 90),
}


def _random_hf(hf_json: dict, seed: int = 0):
    """transformers' model, every parameter and buffer random (as test_families.py's harness);
    the zero-centred (1 + w) norms' weights near 0 like trained ones (scale ~1, as the other
    families' norms). The hybrids' weights are drawn at std 0.1, not 0.2: at 0.2 their logits
    reach |10| and float32 rounding of differently ordered ops (split vs fused projections, the
    attention and expert kernels; the chunked delta rule itself is bitwise transformers') grows
    through the four layers to 1.5e-5."""
    hf_cfg = {k: v for k, v in hf_json.items() if k != "model_type"}
    config = transformers.AutoConfig.for_model(hf_json["model_type"], **hf_cfg)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).float()
    zero_centered = hf_json["model_type"] != "deepseek_v3"
    std = 0.1 if zero_centered else 0.2
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            base = 1.0 if name.endswith("norm.weight") and not zero_centered else 0.0
            if name.endswith("linear_attn.norm.weight"):  # RMSNormGated: plain weight
                base = 1.0
            p.copy_(base + std * torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.3 * torch.randn(b.shape, generator=g))
    return model.eval()


@pytest.fixture(scope="module", params=list(MODEL_CASES))
def model_pair(request, tmp_path_factory):
    from slipstream.model import load_pretrained

    hf_json, seq = MODEL_CASES[request.param]
    hf = _random_hf(hf_json)
    directory = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(directory)
    return hf, directory, load_pretrained(directory), seq


def _as_hf(model, sd):
    from slipstream.model.families import family_of

    return family_of(model.config).weights.to_hf(sd, model.config, True)


def test_model_logits_and_packed_forward_equal_transformers(model_pair):
    hf, _, ours, seq = model_pair
    assert set(_as_hf(ours, ours.state_dict())) == set(hf.state_dict())
    ids = torch.randint(0, 96, (2, seq), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        ref = hf(ids).logits
        torch.testing.assert_close(ours(ids).logits_BTV, ref, atol=1e-5, rtol=1e-5)
        real = torch.ones_like(ids, dtype=torch.bool)
        real[1, 70:] = False  # right padding: GDN and attention see only the real prefix
        packed = ours(ids, skip_padding_BT=real).logits_BTV
        torch.testing.assert_close(packed[0], ref[0], atol=1e-5, rtol=1e-5)
        short = hf(ids[1:, :70]).logits[0]
        torch.testing.assert_close(packed[1, :70], short, atol=1e-5, rtol=1e-5)


def test_model_train_step_loss_and_grads_equal_transformers(model_pair):
    import torch.nn.functional as F

    hf, _, ours, seq = model_pair
    ids = torch.randint(0, 96, (2, seq), generator=torch.Generator().manual_seed(8))
    hf.train()
    ours.train()
    try:
        hf.zero_grad()
        ours.zero_grad()
        ref = hf(ids, labels=ids)
        ref.loss.backward()
        logits = ours(ids).logits_BTV
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
        loss.backward()
        torch.testing.assert_close(loss, ref.loss, atol=1e-5, rtol=1e-5)
        theirs = dict(hf.named_parameters())
        grads = _as_hf(ours, {n: p.grad for n, p in ours.named_parameters()})
        assert set(grads) == set(theirs)
        for name, grad in grads.items():
            torch.testing.assert_close(grad, theirs[name].grad, atol=1e-5, rtol=1e-4, msg=name)
    finally:
        hf.eval()
        ours.eval()


def test_model_save_round_trip_through_transformers(model_pair, tmp_path):
    from slipstream.model import save_pretrained

    hf, directory, ours, _ = model_pair
    save_pretrained(ours, tmp_path)
    assert sorted(load_file(tmp_path / "model.safetensors")) == sorted(
        load_file(directory / "model.safetensors")
    )
    reloaded = type(hf).from_pretrained(tmp_path).eval()
    ids = torch.randint(0, 96, (1, 40), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, hf(ids).logits, atol=0, rtol=0)


def test_gdn_layers_refuse_a_kv_cache_without_their_recurrent_state():
    from slipstream.model import MoEForCausalLM, model_config_from_hf

    ours = MoEForCausalLM(model_config_from_hf(qwen3_next.tiny_hf_config()))

    class _Cache:
        length = 0

        def attend(self, layer_idx, q, k, v, **kw):  # pragma: no cover - never reached
            raise AssertionError

    with torch.no_grad(), pytest.raises(NotImplementedError, match="layer 0 is a Gated DeltaNet"):
        ours(torch.zeros(1, 3, dtype=torch.long), cache=_Cache())


def test_model_routing_replay_is_exact(model_pair, tmp_path):
    """R3: the expert ids a forward routed to, replayed, give the same logits bitwise; the
    router keeps its gradient; DeepSeek's correction bias steers live selection only."""
    from slipstream.model import load_pretrained
    from slipstream.model.moe_block import SparseMoeBlock

    _, directory, _, seq = model_pair
    model = load_pretrained(directory)  # a copy: the correction bias is changed below
    blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
    ids = torch.randint(0, 96, (2, seq), generator=torch.Generator().manual_seed(10))

    def record() -> torch.Tensor:
        seen: list[torch.Tensor] = []
        for b in blocks:
            b.routing_sink = lambda ids_Nk: seen.append(ids_Nk.clone())
        try:
            with torch.no_grad():
                model(ids)
        finally:
            for b in blocks:
                b.routing_sink = None
        return torch.stack(seen)

    recorded = record()
    with torch.no_grad():
        live = model(ids).logits_BTV
        assert torch.equal(model(ids, replay_routing_LNk=recorded).logits_BTV, live)
    out = model(ids, replay_routing_LNk=recorded)
    out.logits_BTV.logsumexp(-1).sum().backward()
    assert all(
        b.gate.weight.grad is not None and b.gate.weight.grad.abs().sum() > 0 for b in blocks
    )
    bias = blocks[0].gate.e_score_correction_bias
    if bias is None:
        return
    with torch.no_grad():
        for b in blocks:
            b.gate.e_score_correction_bias.add_(torch.randn(bias.shape) * 3)
        assert not torch.equal(record(), recorded)
        assert torch.equal(model(ids, replay_routing_LNk=recorded).logits_BTV, live)


def test_meta_built_model_initialises_every_hybrid_parameter():
    """Built on the meta device then `init_weights` (bench presets, sharded loading): the GDN's
    dt_bias, A_log, gated norm and conv and the zero-centred norms get their init, not the
    uninitialised memory `to_empty` leaves."""
    from slipstream.model import MoEForCausalLM, model_config_from_hf

    with torch.device("meta"):
        model = MoEForCausalLM(model_config_from_hf(qwen3_next.tiny_hf_config()))
    model = model.to_empty(device="cpu")
    for p in model.parameters():
        p.data.fill_(float("nan"))
    model.init_weights()
    assert all(torch.isfinite(p).all() for p in model.parameters())
    gdn = model.model.layers[0].linear_attn
    assert gdn is not None and torch.equal(gdn.dt_bias, torch.ones(4))
    assert ((gdn.A_log.exp() >= 0.0099) & (gdn.A_log.exp() <= 16.01)).all()
    assert torch.equal(gdn.norm.weight, torch.ones(6))
    assert torch.equal(model.model.norm.weight, torch.zeros(32))
    assert torch.equal(model.model.layers[3].self_attn.q_norm.weight, torch.zeros(16))


@pytest.mark.parametrize("family", ["qwen3_next", "deepseek_v3"])
def test_trainer_step_has_no_host_sync(family):
    """The RL trainer's forward + GRPO loss + backward on a right-padded batch (the packed
    path): no host sync in the GDN (chunked rule, conv) or MLA layers. At the mid shape (16
    layers, 2 x 256 tokens; see docs/model.md) it is 12,253 ops for a Qwen3.5-like hybrid and
    6,257 for MLA, against Qwen3-MoE's 2,969, all without a sync."""
    from slipstream.model import model_config_from_hf
    from unit.test_trainer_ops import trainer_step_ops

    hf = {"qwen3_next": qwen3_next, "deepseek_v3": deepseek_v3}[family].tiny_hf_config()
    counted = trainer_step_ops(model_config_from_hf(hf), prompt_len=5, completion_lens=[70, 3, 9])
    assert counted.syncs == 0, f"host syncs in the trainer step: {counted.sync_ops()}"


DEEPSEEK_V3_CONFIG = {
    "model_type": "deepseek_v3", "vocab_size": 129280, "hidden_size": 7168,
    "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
    "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1,
    "n_routed_experts": 256, "routed_scaling_factor": 2.5, "kv_lora_rank": 512,
    "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128,
    "topk_method": "noaux_tc", "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8,
    "moe_layer_freq": 1, "first_k_dense_replace": 3, "norm_topk_prob": True,
    "scoring_func": "sigmoid", "hidden_act": "silu", "max_position_embeddings": 163840,
    "rms_norm_eps": 1e-06, "rope_theta": 10000, "tie_word_embeddings": False,
    "num_nextn_predict_layers": 1,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                     "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                     "type": "yarn"},
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3",
                            "quant_method": "fp8", "weight_block_size": [128, 128]},
}  # fmt: skip
"""DeepSeek-V3's released config.json (the FP8 release), as published."""


def test_released_configs_map_to_the_published_sizes():
    """DeepSeek-V3 671B total / 37B active; Qwen3.5-35B-A3B (transformers' default config is
    that model). (Qwen3-Next-80B-A3B, transformers' default too, maps to 79.7B / 3.87B: left out
    here, its 48 layers of 512 experts take seconds to build even on the meta device.)"""
    from slipstream.model import MoEForCausalLM, model_config_from_hf

    cases = [
        (DEEPSEEK_V3_CONFIG, 671.0, 37.6),
        (transformers.Qwen3_5MoeTextConfig().to_dict(), 34.7, 3.45),
    ]
    for hf, total_b, active_b in cases:
        cfg = model_config_from_hf(hf)
        with torch.device("meta"):
            model = MoEForCausalLM(cfg)
        assert model.num_parameters() / 1e9 == pytest.approx(total_b, abs=0.05), hf["model_type"]
        assert model.num_parameters(active=True) / 1e9 == pytest.approx(active_b, abs=0.05)
    ds = model_config_from_hf(DEEPSEEK_V3_CONFIG)
    assert ds.head_dim == 64 and ds.rope_scaling is not None
    assert ds.rope_scaling.attention_factor == 1.0 and ds.rope_scaling.mscale_all_dim == 1.0


def test_deepseek_config_keeps_its_rope_theta_and_refuses_other_routing():
    """Moonlight-like: plain RoPE with its own theta (no rope_scaling)."""
    from slipstream.model import model_config_from_hf

    moonlight = {**DEEPSEEK_V3_CONFIG, "rope_scaling": None, "rope_theta": 50000.0}
    moonlight.pop("quantization_config")
    cfg = model_config_from_hf(moonlight)
    assert cfg.rope_theta == 50000.0 and cfg.rope_scaling is None
    for key, value in (("scoring_func", "softmax"), ("topk_method", "greedy"),
                       ("moe_layer_freq", 2)):  # fmt: skip
        with pytest.raises(ValueError, match=key):
            deepseek_v3.config_from_hf({**moonlight, key: value})


def test_the_native_engine_serves_a_hybrid_model_with_per_layer_state() -> None:
    """The engine starts on a hybrid (it refused before it had per-layer state): K/V pages for
    the full-attention layer only, a GDN state per slot for the others. Equality with
    transformers: tests/unit/test_engine_hybrid.py."""
    from slipstream.config.engine import EngineConfig
    from slipstream.engine import GenerateRequest, NativeEngine, SamplingParams
    from slipstream.model import MoEForCausalLM, model_config_from_hf

    ours = MoEForCausalLM(model_config_from_hf(qwen3_next.tiny_hf_config()))
    cfg = EngineConfig(kv_cache_tokens=2 * 32, max_seq_len=32, max_batch_size=2)
    with NativeEngine(ours, cfg) as engine:
        cache = engine.batch.cache
        assert cache.attention_layers == [3] and cache.linear_layers == [0, 1, 2]
        (c,) = engine.generate([GenerateRequest([1, 2, 3], SamplingParams(max_new_tokens=4))])
        assert len(c.token_ids) == 4
