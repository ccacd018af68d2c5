"""The benchmark model presets (ModelConfig overrides) that bench engine, limits and train share:
"quickstart" (the quickstart's MoE shape) and "larger" (hidden 256, 8 layers, 16 experts); and
the GPU-scale presets of `bench train --preset` (complete shapes, vocabulary included)."""

MODELS = {
    "quickstart": dict(hidden_size=128, num_hidden_layers=4, num_experts=8, num_experts_per_tok=2),
    "larger": dict(
        hidden_size=256, num_hidden_layers=8, num_experts=16, num_experts_per_tok=2,
        num_attention_heads=8, num_key_value_heads=4, moe_intermediate_size=256,
    ),
}  # fmt: skip

GPU_PRESETS = {
    # issue 29's mid shape: 0.91B parameters, 176M active
    "mid": dict(
        vocab_size=32_000, hidden_size=1024, num_hidden_layers=16, num_attention_heads=16,
        num_key_value_heads=4, head_dim=64, moe_intermediate_size=512, num_experts=32,
        num_experts_per_tok=4, max_position_embeddings=4096,
    ),
    # Qwen3-30B-A3B's real decoder layer, 4 of them, and its vocabulary
    "qwen3-30b-a3b-4l": dict(
        vocab_size=151_936, hidden_size=2048, num_hidden_layers=4, num_attention_heads=32,
        num_key_value_heads=4, head_dim=128, moe_intermediate_size=768, num_experts=128,
        num_experts_per_tok=8, max_position_embeddings=4096, rope_theta=1_000_000.0,
    ),
    # a CPU-test scale (tests/unit/test_bench_train.py)
    "tiny": dict(
        vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, moe_intermediate_size=32, num_experts=8,
        num_experts_per_tok=2, max_position_embeddings=256,
    ),
}  # fmt: skip
