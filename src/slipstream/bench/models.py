"""The benchmark model presets (ModelConfig overrides) that bench engine, limits and train share:
"quickstart" (the quickstart's MoE shape), "larger" (hidden 256, 8 layers, 16 experts), and the
GPU-scale shapes of issue 30: "mid" (hidden 1024, 16 layers, 16 / 4 heads of 64, 32 experts
top-4 of width 512; 0.91B parameters at vocab 32,000) and "qwen3-30b-a3b-4l" (Qwen3-30B-A3B's
layer shape, 4 of its 48 layers: hidden 2048, 32 / 4 heads of 128, 128 experts top-8 of width
768; vocab 151,936 is the caller's `vocab_size`), "gpt-oss-20b-4l" (gpt-oss-20b's layer shape and
architecture, 4 of its 24 layers) and "gpt-oss-mid" (mid's shape, GPT-OSS's architecture: the
family's CPU proxies). `VOCAB` gives "mid" its
32,000 vocabulary where a bench (weights) needs it; 3.6 GB in fp32. `GPU_PRESETS`: the
complete shapes of `bench train --preset` (vocabulary included)."""

from __future__ import annotations

from typing import Any

MODELS = {
    "quickstart": dict(hidden_size=128, num_hidden_layers=4, num_experts=8, num_experts_per_tok=2),
    "larger": dict(
        hidden_size=256, num_hidden_layers=8, num_experts=16, num_experts_per_tok=2,
        num_attention_heads=8, num_key_value_heads=4, moe_intermediate_size=256,
    ),
    "mid": dict(
        hidden_size=1024, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=4,
        head_dim=64, num_experts=32, num_experts_per_tok=4, moe_intermediate_size=512,
    ),
    "qwen3-30b-a3b-4l": dict(
        hidden_size=2048, num_hidden_layers=4, num_attention_heads=32, num_key_value_heads=4,
        head_dim=128, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
    ),
}  # fmt: skip

GPT_OSS = dict(
    model_type="gpt_oss", router_scheme="topk_softmax", router_bias=True, qk_norm="none",
    attention_bias=True, attention_out_bias=True, attention_sinks=True, expert_bias=True,
    expert_activation="clamped_swiglu", norm_weight_in_float32=True, rope_theta=150_000.0,
    rope_scaling=dict(factor=32.0, original_max_position_embeddings=4096, truncate=False),
    sliding_window=128,
)  # fmt: skip
"""The GPT-OSS architecture switches (model/families/gpt_oss.py sets the same from a config.json),
to put on a preset's shape (with `layer_types`: `gpt_oss_layers`)."""


def gpt_oss_layers(num_layers: int) -> list[str]:
    """GPT-OSS's alternation: sliding-window layers at even indices, full at odd."""
    return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)]


MODELS["gpt-oss-20b-4l"] = dict(
    # gpt-oss-20b's decoder layer, 4 of its 24: hidden 2880, 64 / 8 heads of 64, 32 experts
    # top-4 of width 2880 (vocab 201,088 is the caller's `vocab_size`)
    hidden_size=2880, num_hidden_layers=4, num_attention_heads=64, num_key_value_heads=8,
    head_dim=64, num_experts=32, num_experts_per_tok=4, moe_intermediate_size=2880,
    intermediate_size=2880, rms_norm_eps=1e-5, layer_types=gpt_oss_layers(4), **GPT_OSS,
)  # fmt: skip
# GPT-OSS has one FFN width (no dense layers): intermediate_size = moe_intermediate_size, as its
# checkpoints need
MODELS["gpt-oss-mid"] = dict(
    **MODELS["mid"], intermediate_size=512, layer_types=gpt_oss_layers(16), **GPT_OSS
)
"""The `mid` shape with GPT-OSS's architecture: the CPU op/sync proxies of the family."""
MODELS["gpt-oss-quickstart"] = dict(
    **MODELS["quickstart"],
    intermediate_size=128,
    layer_types=gpt_oss_layers(4),
    **{**GPT_OSS, "sliding_window": 8},
)
"""The quickstart's shape with GPT-OSS's architecture (CPU rehearsals, tiny RL runs)."""

VOCAB = {"mid": 32_000, "gpt-oss-mid": 32_000}
"""Vocabulary of a preset whose vocabulary is not the task tokenizer's."""

GPU_PRESETS = {
    # issue 29's mid shape: 0.91B parameters, 176M active (the engine's "mid", one definition)
    "mid": {**MODELS["mid"], "vocab_size": VOCAB["mid"], "max_position_embeddings": 4096},
    # Qwen3-30B-A3B's real decoder layer, 4 of them, its vocabulary and RoPE base
    "qwen3-30b-a3b-4l": {
        **MODELS["qwen3-30b-a3b-4l"], "vocab_size": 151_936, "max_position_embeddings": 4096,
        "rope_theta": 1_000_000.0,
    },
    # gpt-oss-20b's real decoder layer, 4 of them, its vocabulary
    "gpt-oss-20b-4l": {**MODELS["gpt-oss-20b-4l"], "vocab_size": 201_088,
                       "max_position_embeddings": 4096},  # fmt: skip
    # the CPU rehearsal of the gpt-oss phase (scripts/gpu-check.sh)
    "gpt-oss-tiny": dict(
        vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, moe_intermediate_size=32, intermediate_size=32,
        num_experts=8, num_experts_per_tok=2, max_position_embeddings=256,
        layer_types=gpt_oss_layers(2),
        **{**GPT_OSS, "sliding_window": 8},
    ),
    # a CPU-test scale (tests/unit/test_bench_train.py)
    "tiny": dict(
        vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, moe_intermediate_size=32, num_experts=8,
        num_experts_per_tok=2, max_position_embeddings=256,
    ),
}  # fmt: skip


def build_bench_model(name: str, vocab: int, max_pos: int, device: str, seed: int,
                      dtype: str = "float32") -> Any:  # fmt: skip
    """Random weights made on `device` (a 3B-parameter preset initialised on the host would take
    a minute), then cast to `dtype`."""
    import torch

    from slipstream.config.model import ModelConfig
    from slipstream.model import MoEForCausalLM

    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=vocab, max_position_embeddings=max_pos, **MODELS[name])
    with torch.device("meta"):
        model = MoEForCausalLM(cfg)
    model = model.to_empty(device=device)
    model.init_weights()
    model.tie_weights()
    return model.to(getattr(torch, dtype)).eval()


# ---- model families of issue 47 part A (model/families/): real layer shapes, 4 layers each,
# and each family's switches on the quickstart shape (CPU rehearsals, tiny RL runs) ----------
GLM4_MOE = dict(
    model_type="glm4_moe", router_scheme="sigmoid_group_topk", router_correction_bias=True,
    shared_expert_gated=False, attention_bias=True, qk_norm="none", partial_rotary_factor=0.5,
    router_aux_loss_coef=0.0, mlp_only_layers=[0],
)  # fmt: skip
"""GLM-4.5's architecture switches (model/families/glm4_moe.py sets the same from config.json)."""
MIXTRAL = dict(model_type="mixtral", qk_norm="none", norm_topk_prob=True)
"""Mixtral's architecture switches."""
OLMOE = dict(model_type="olmoe", qk_norm="full", norm_topk_prob=False)
"""OLMoE's architecture switches (OLMoE-1B-7B-0924: clip_qkv null)."""

MODELS.update({
    # GLM-4.5-Air's decoder layers, 4 of its 46 (the first dense): hidden 4096, 96 / 8 heads
    # of 128, 128 routed experts top-8 of width 1408 + 1 shared, dense width 10,944
    "glm-4.5-air-4l": dict(
        hidden_size=4096, num_hidden_layers=4, num_attention_heads=96, num_key_value_heads=8,
        head_dim=128, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=1408,
        intermediate_size=10944, shared_expert_intermediate_size=1408, rms_norm_eps=1e-5,
        rope_theta=1_000_000.0, **GLM4_MOE,
    ),
    # Mixtral-8x7B's decoder layer, 4 of its 32: hidden 4096, 32 / 8 heads of 128, 8 experts
    # top-2 of width 14,336
    "mixtral-8x7b-4l": dict(
        hidden_size=4096, num_hidden_layers=4, num_attention_heads=32, num_key_value_heads=8,
        head_dim=128, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=14336,
        intermediate_size=14336, rms_norm_eps=1e-5, rope_theta=1_000_000.0, **MIXTRAL,
    ),
    # OLMoE-1B-7B's decoder layer, 4 of its 16: hidden 2048, 16 / 16 heads of 128, 64 experts
    # top-8 of width 1024
    "olmoe-1b-7b-4l": dict(
        hidden_size=2048, num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=16,
        head_dim=128, num_experts=64, num_experts_per_tok=8, moe_intermediate_size=1024,
        intermediate_size=1024, rms_norm_eps=1e-5, **OLMOE,
    ),
    # the quickstart shape with each family's switches
    "glm4_moe-quickstart": dict(**MODELS["quickstart"], n_group=2, topk_group=1,
                                shared_expert_intermediate_size=128, **GLM4_MOE),
    "mixtral-quickstart": dict(**MODELS["quickstart"], **MIXTRAL),
    "olmoe-quickstart": dict(**MODELS["quickstart"], num_key_value_heads=4, clip_qkv=8.0,
                             attention_bias=True, attention_out_bias=True, **OLMOE),
})  # fmt: skip
FAMILY_PRESETS = ("glm-4.5-air-4l", "mixtral-8x7b-4l", "olmoe-1b-7b-4l")
"""The family presets at real layer shapes (scripts/gpu-check.sh's `families` phase)."""


# ---- the hybrid and latent-attention families of issue 48 (model/families/qwen3_next.py,
# qwen3_5_moe.py, deepseek_v3.py): real layer shapes, 4 layers each, and each family's switches
# on the quickstart shape (CPU rehearsals, tiny RL runs) ----------------------------------------
QWEN3_NEXT = dict(
    model_type="qwen3_next", attention_output_gate=True, norm_zero_centered=True,
    partial_rotary_factor=0.25, qk_norm="per_head", shared_expert_gated=True,
)  # fmt: skip
"""Qwen3-Next's architecture switches (model/families/qwen3_next.py sets the same from
config.json); Qwen3.5/3.6 MoE is the same architecture (`QWEN3_5_MOE`)."""
QWEN3_5_MOE = dict(QWEN3_NEXT, model_type="qwen3_5_moe_text")
"""Qwen3.5/3.6-MoE's switches: Qwen3-Next's, saved in the text layout (split GDN projections)."""
DEEPSEEK_V3 = dict(
    model_type="deepseek_v3", router_scheme="sigmoid_group_topk", router_correction_bias=True,
    shared_expert_gated=False, qk_norm="none", router_aux_loss_coef=0.0, rope_interleave=True,
)  # fmt: skip
"""DeepSeek-V3's architecture switches (model/families/deepseek_v3.py sets the same)."""


def hybrid_layers(num_layers: int, interval: int = 4) -> list[str]:
    """Qwen3-Next's pattern: a full-attention layer after every `interval - 1` GDN layers."""
    return [
        "full_attention" if (i + 1) % interval == 0 else "linear_attention"
        for i in range(num_layers)
    ]


MODELS.update({
    # Qwen3.6-35B-A3B's decoder layers, 4 of its 40 (3 GDN + 1 gated full attention): hidden
    # 2048, 16 / 2 heads of 256 (rotary on 64 of them), GDN 16 key heads of 128 and 32 value
    # heads of 128, conv 4, 256 experts top-8 of width 512 + a gated shared expert of 512
    "qwen3.6-35b-a3b-4l": dict(
        hidden_size=2048, num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=2,
        head_dim=256, num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
        intermediate_size=512, shared_expert_intermediate_size=512, rope_theta=10_000_000.0,
        layer_types=hybrid_layers(4), linear_num_key_heads=16, linear_num_value_heads=32,
        linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
        **QWEN3_5_MOE,
    ),
    # Moonlight-16B-A3B's decoder layers, 4 of its 27 (the first dense): hidden 2048, 16 MLA
    # heads (q_lora_rank none, kv_lora_rank 512, qk_nope 128 + qk_rope 64, v 128), 64 experts
    # top-6 of width 1408 + 2 shared, dense width 11,264, sigmoid routing over 1 group
    "moonlight-16b-4l": dict(
        hidden_size=2048, num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=16,
        head_dim=64, num_experts=64, num_experts_per_tok=6, moe_intermediate_size=1408,
        intermediate_size=11264, shared_expert_intermediate_size=2 * 1408, mlp_only_layers=[0],
        n_group=1, topk_group=1, routed_scaling_factor=2.446, rope_theta=50_000.0,
        rms_norm_eps=1e-5, kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, **DEEPSEEK_V3,
    ),
    # the quickstart shape with each family's switches (every feature on: GDN with grouped
    # value heads, a shared expert; MLA with a low-rank q, n_group > 1, a dense first layer)
    "qwen3_next-quickstart": dict(
        **MODELS["quickstart"], layer_types=hybrid_layers(4), linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
        shared_expert_intermediate_size=128, **QWEN3_NEXT,
    ),
    "qwen3_5_moe-quickstart": dict(
        **MODELS["quickstart"], layer_types=hybrid_layers(4), linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
        shared_expert_intermediate_size=128, intermediate_size=128, **QWEN3_5_MOE,
    ),
    "deepseek_v3-quickstart": dict(
        **MODELS["quickstart"], num_attention_heads=4, num_key_value_heads=4, head_dim=16,
        kv_lora_rank=64, q_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16,
        v_head_dim=32, n_group=2, topk_group=1, routed_scaling_factor=2.5,
        shared_expert_intermediate_size=256, mlp_only_layers=[0], **DEEPSEEK_V3,
    ),
})  # fmt: skip
MODELS["qwen3.6-35b-a3b-2l"] = dict(
    MODELS["qwen3.6-35b-a3b-4l"], num_hidden_layers=2,
    layer_types=["linear_attention", "full_attention"],
)  # fmt: skip
"""One GDN and one full-attention layer of Qwen3.6-35B-A3B: the trainer's run (4 layers and the
vocabulary are 4.4B parameters, ~70 GB of float32 weights, gradients and AdamW state: past an
80 GB GPU with activations; 2 layers are 2.7B, ~43 GB)."""
HYBRID_PRESETS = ("qwen3.6-35b-a3b-4l", "moonlight-16b-4l")
"""The issue-48 family presets at real layer shapes (scripts/gpu-check.sh's `hybrid` phase)."""
VOCAB.update({"qwen3.6-35b-a3b-4l": 248_320, "qwen3.6-35b-a3b-2l": 248_320,
              "moonlight-16b-4l": 163_840})  # fmt: skip
GPU_PRESETS.update({
    # the real decoder layers (above) with each model's vocabulary
    **{name: {**MODELS[name], "vocab_size": VOCAB[name], "max_position_embeddings": 4096}
       for name in ("qwen3.6-35b-a3b-4l", "qwen3.6-35b-a3b-2l", "moonlight-16b-4l")},
    # the CPU rehearsals of the hybrid phase (scripts/gpu-check.sh)
    **{f"{family}-tiny": {**MODELS[f"{family}-quickstart"], "vocab_size": 256,
                          "max_position_embeddings": 256}
       for family in ("qwen3_5_moe", "deepseek_v3")},
})  # fmt: skip
