"""The benchmark model presets (ModelConfig overrides) that bench engine, limits and train share:
"quickstart" (the quickstart's MoE shape), "larger" (hidden 256, 8 layers, 16 experts), and the
GPU-scale shapes of issue 30: "mid" (hidden 1024, 16 layers, 16 / 4 heads of 64, 32 experts
top-4 of width 512; 0.91B parameters at vocab 32,000) and "qwen3-30b-a3b-4l" (Qwen3-30B-A3B's
layer shape, 4 of its 48 layers: hidden 2048, 32 / 4 heads of 128, 128 experts top-8 of width
768; vocab 151,936 is the caller's `vocab_size`). `VOCAB` gives "mid" its
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

VOCAB = {"mid": 32_000}
"""Vocabulary of a preset whose vocabulary is not the task tokenizer's."""

GPU_PRESETS = {
    # issue 29's mid shape: 0.91B parameters, 176M active (the engine's "mid", one definition)
    "mid": {**MODELS["mid"], "vocab_size": VOCAB["mid"], "max_position_embeddings": 4096},
    # Qwen3-30B-A3B's real decoder layer, 4 of them, its vocabulary and RoPE base
    "qwen3-30b-a3b-4l": {
        **MODELS["qwen3-30b-a3b-4l"], "vocab_size": 151_936, "max_position_embeddings": 4096,
        "rope_theta": 1_000_000.0,
    },
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
