"""Reward models (RLHF): a scalar head on the MoE backbone trained Bradley-Terry on preference
pairs (`train`), saved as transformers' Qwen3MoeForSequenceClassification (`model`), served
over HTTP (`server`: POST /classify) or scored in-process, and called by rollout workers as a
reward source (`source`). docs/rlhf.md. Importing `slipstream.rm.model` imports torch."""
