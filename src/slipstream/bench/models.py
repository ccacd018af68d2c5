"""The benchmark model presets (ModelConfig overrides) that bench engine, limits and train share:
"quickstart" (the quickstart's MoE shape) and "larger" (hidden 256, 8 layers, 16 experts)."""

MODELS = {
    "quickstart": dict(hidden_size=128, num_hidden_layers=4, num_experts=8, num_experts_per_tok=2),
    "larger": dict(
        hidden_size=256, num_hidden_layers=8, num_experts=16, num_experts_per_tok=2,
        num_attention_heads=8, num_key_value_heads=4, moe_intermediate_size=256,
    ),
}  # fmt: skip
