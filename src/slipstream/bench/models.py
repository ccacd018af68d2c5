"""The benchmark model presets (ModelConfig overrides) that bench engine, limits and train share:
"quickstart" (the quickstart's MoE shape), "larger" (hidden 256, 8 layers, 16 experts) and "mid"
(0.91B parameters with a 32,000 vocabulary: hidden 1024, 16 layers, 32 experts top-4; 3.6 GB in
fp32; bench weights)."""

MODELS = {
    "quickstart": dict(hidden_size=128, num_hidden_layers=4, num_experts=8, num_experts_per_tok=2),
    "larger": dict(
        hidden_size=256, num_hidden_layers=8, num_experts=16, num_experts_per_tok=2,
        num_attention_heads=8, num_key_value_heads=4, moe_intermediate_size=256,
    ),
    "mid": dict(
        hidden_size=1024, num_hidden_layers=16, num_experts=32, num_experts_per_tok=4,
        num_attention_heads=16, num_key_value_heads=4, head_dim=64, moe_intermediate_size=512,
    ),
}  # fmt: skip

VOCAB = {"mid": 32_000}
"""Vocabulary of a preset whose vocabulary is not the task tokenizer's."""
