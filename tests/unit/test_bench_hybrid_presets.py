"""The issue-48 bench presets (bench/models.py: Qwen3.6-35B-A3B's and Moonlight-16B-A3B's real
decoder layers, each family's switches on the quickstart shape) are valid configs that build
(on the meta device: no memory) and save as their family's checkpoint config, and the bench
formulas (bench/model_flops.py, bench/gemms.py) count what these models hold and compute:
parameters equal to the built model's, matmul FLOPs equal to a brute-force count of the real
forward (MLA, gated attention) and of one cached decode step (Gated DeltaNet's recurrent form),
the GEMM lists equal to the formula."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from slipstream.bench import model_flops as mf
from slipstream.bench.gemms import decode_gemms, decode_read_bytes, train_gemms
from slipstream.bench.models import GPU_PRESETS, HYBRID_PRESETS, MODELS
from slipstream.config.model import ModelConfig
from slipstream.engine.kv_cache import Part, SlotKVCache
from slipstream.model import MoEForCausalLM
from slipstream.model.families import family_of

QUICKSTART = ("qwen3_next-quickstart", "qwen3_5_moe-quickstart", "deepseek_v3-quickstart")


def _cfg(name: str, **update: object) -> ModelConfig:
    return ModelConfig(
        **{"vocab_size": 40, "max_position_embeddings": 64, **MODELS[name], **update}
    )


@pytest.mark.parametrize("name", [*HYBRID_PRESETS, "qwen3.6-35b-a3b-2l", *QUICKSTART])
def test_preset_builds_on_meta_and_counts_its_parameters(name: str) -> None:
    cfg = ModelConfig(**GPU_PRESETS[name]) if name in GPU_PRESETS else _cfg(name)
    with torch.device("meta"):
        model = MoEForCausalLM(cfg)
    assert mf.num_params(cfg) == model.num_parameters()
    assert mf.num_params(cfg, active=True) == model.num_parameters(active=True)
    hf = family_of(cfg).config_to_hf(cfg)  # expressible as its family's checkpoint
    assert hf["num_hidden_layers"] == cfg.num_hidden_layers


def test_real_shapes() -> None:
    """The layer shapes the presets claim (Qwen3.6-35B-A3B, Moonlight-16B-A3B config.json)."""
    q = ModelConfig(**GPU_PRESETS["qwen3.6-35b-a3b-4l"])
    assert q.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    assert (q.hidden_size, q.num_experts, q.num_experts_per_tok, q.moe_intermediate_size,
            q.shared_expert_intermediate_size) == (2048, 256, 8, 512, 512)  # fmt: skip
    assert (q.linear_num_key_heads, q.linear_num_value_heads, q.linear_key_head_dim,
            q.linear_value_head_dim) == (16, 32, 128, 128)  # fmt: skip
    m = ModelConfig(**GPU_PRESETS["moonlight-16b-4l"])
    assert (m.kv_lora_rank, m.q_lora_rank, m.qk_rope_head_dim, m.qk_nope_head_dim,
            m.v_head_dim) == (512, None, 64, 128, 128)  # fmt: skip
    assert (m.num_experts, m.num_experts_per_tok, m.mlp_only_layers) == (64, 6, [0])
    assert m.shared_expert_intermediate_size == 2 * m.moe_intermediate_size


def _grouped_mm_flops(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:  # type: ignore[no-untyped-def]
    """torch._grouped_mm (the grouped experts; not in the counter's table; test_limits.py)."""
    if len(b_shape) == 3:
        return 2 * a_shape[0] * a_shape[1] * b_shape[2]
    return 2 * a_shape[0] * a_shape[1] * b_shape[1]


def _count(fn) -> int:  # type: ignore[no-untyped-def]
    # the math SDPA backend runs attention as matmuls the counter sees (see test_limits.py)
    mapping = {torch.ops.aten._grouped_mm: _grouped_mm_flops}
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False, custom_mapping=mapping) as c:
        fn()
    return c.get_total_flops()


@pytest.mark.parametrize(
    "name,update",
    [
        ("deepseek_v3-quickstart", {}),
        ("deepseek_v3-quickstart", {"q_lora_rank": None}),
        ("qwen3_next-quickstart", {"layer_types": ["full_attention"] * 4}),
    ],  # fmt: skip
)
def test_attention_flops_equal_a_brute_force_count(name: str, update: dict) -> None:
    """MLA (low-rank q and a plain q_proj) and gated attention: the formula is the forward's
    matmuls exactly (all T keys per query, as the dense math kernel computes)."""
    cfg = _cfg(name, **update)
    torch.manual_seed(0)
    model = MoEForCausalLM(cfg)
    B, T = 2, 9
    ids = torch.randint(3, cfg.vocab_size, (B, T))
    fwd = _count(lambda: model(ids))
    combine = B * T * sum(mf.layer_flops(cfg, i).combine for i in range(cfg.num_hidden_layers))
    assert fwd + combine == B * T * mf.forward_flops_per_token(cfg, attended_keys=T)


@pytest.mark.parametrize("name", ["qwen3_next-quickstart", "deepseek_v3-quickstart"])
def test_decode_flops_equal_a_brute_force_count_of_one_cached_step(name: str) -> None:
    """One cached decode step: GDN layers run the recurrent form (conv window, three state
    products per value head), attention layers attend to the P + 1 cached positions."""
    cfg = _cfg(name)
    torch.manual_seed(0)
    model = MoEForCausalLM(cfg).eval()
    B, P = 2, 9  # 2 rows x top-2 < 8 experts: the engine's grouped expert path (no padding)
    cache = SlotKVCache.for_model(model, B, 32)
    ids = torch.randint(3, cfg.vocab_size, (B, P))
    parts = [Part(b, b * P, P) for b in range(B)]
    with torch.inference_mode():
        cache.begin_mixed(torch.empty(0, dtype=torch.long), -1, parts)
        model(ids.reshape(1, -1), position_ids_BT=torch.arange(P).repeat(B)[None], cache=cache)
        pos_B = torch.full((B,), P)
        cache.begin_decode(pos_B, P)
        step = _count(lambda: model(ids[:, :1], position_ids_BT=pos_B[:, None], cache=cache))
    combine = B * sum(mf.layer_flops(cfg, i).combine for i in range(cfg.num_hidden_layers))
    # the recurrent step's state products are broadcast multiply-adds (model/gated_deltanet.py),
    # which the counter does not see, like the combine; everything else is its matmuls exactly
    state = 6 * cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim
    unseen = B * state * sum(mf.is_linear_attention_layer(cfg, i) for i in range(4))
    assert step + combine + unseen == B * mf.decode_flops_per_token(cfg, context_len=P + 1)


@pytest.mark.parametrize("name", QUICKSTART)
def test_gemm_lists_add_up_to_the_formula(name: str) -> None:
    cfg = _cfg(name)
    T, seqs = 12, 8
    N = T * seqs  # N * k / E rows per expert exactly
    train = train_gemms(cfg, N, T)
    assert sum(g.count * g.flops_per_call for g in train) == pytest.approx(
        N * mf.train_flops_per_token(cfg, T), rel=1e-12
    )
    batch, ctx = 64, 20
    total = sum(g.count * g.flops_per_call for g in decode_gemms(cfg, batch, ctx))
    assert total >= batch * mf.decode_flops_per_token(cfg, ctx) * (1 - 1e-12)
    # (64 x top-2 rows over the ~8 experts hit: 17 rows each, not 16: experts are most of it)
    assert total <= batch * mf.decode_flops_per_token(cfg, ctx) * (1 + 1 / 16)
    # a GDN layer's decode state does not grow with the context; attention's K/V does
    grow = decode_read_bytes(cfg, batch, 2 * ctx, 4) - decode_read_bytes(cfg, batch, ctx, 4)
    attention = [i for i in range(4) if not mf.is_linear_attention_layer(cfg, i)]
    if cfg.kv_lora_rank:
        width = cfg.num_attention_heads * (
            cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim
        )
    else:
        width = 2 * cfg.num_key_value_heads * cfg.head_dim
    assert grow == 4 * batch * ctx * width * len(attention)
