"""What the compat suite's server fixture (conftest.py) starts and the tests import: the served
server's facts and the tiny model it serves."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

MAX_SEQ_LEN = 128


@dataclass
class Served:
    url: str
    name: str  # the served model name (the checkpoint directory's name)
    ckpt: Path
    other: Path  # a checkpoint with other weights
    vocab_size: int


def tiny(seed: int, vocab_size: int):  # noqa: ANN202
    """A random 2-layer MoE (initializer_range 0.2: peaked logits, no greedy near-ties)."""
    import torch

    from slipstream.config.model import ModelConfig
    from slipstream.model import MoEForCausalLM

    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=vocab_size, hidden_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      moe_intermediate_size=64, num_experts=4, num_experts_per_tok=2,
                      max_position_embeddings=MAX_SEQ_LEN, initializer_range=0.2)  # fmt: skip
    return MoEForCausalLM(cfg).eval()
