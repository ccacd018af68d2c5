"""Aten ops and host syncs of one trainer forward + backward at the `mid` shape (issue 29):
hidden 1024, 16 layers, 16 query / 4 KV heads, head_dim 64, 32 experts top-4, moe_intermediate
512, vocab 32,000 (0.91B parameters), 2 x 256 tokens, the config's defaults, counted in-thread
by a TorchDispatchMode (observe/op_count.py) on the real model in float32 on the CPU.

Before this work (f59355b): 13,550 ops and 26 host syncs (16 `.tolist()` of the grouped experts'
segment sizes, 9 `.item()`, 1 `nonzero`). The budget: <= 3,000 ops, 0 syncs. A change that adds
a sync or pushes the count over fails here and names the ops."""

from __future__ import annotations

import pytest
import torch

from slipstream.config.model import ModelConfig
from slipstream.config.rl import TrainerConfig
from slipstream.model import MoEForCausalLM
from slipstream.observe.op_count import OpCount, count_ops
from slipstream.rl.trainer import Trainer, collate
from slipstream.rl.types import Sample

MAX_OPS = 3000

MID = dict(
    vocab_size=32_000,
    hidden_size=1024,
    num_hidden_layers=16,
    num_attention_heads=16,
    num_key_value_heads=4,
    head_dim=64,
    moe_intermediate_size=512,
    num_experts=32,
    num_experts_per_tok=4,
    max_position_embeddings=512,
)


def trainer_step_ops(cfg: ModelConfig, prompt_len: int, completion_lens: list[int]) -> OpCount:
    """The ops of `Trainer._forward_backward` (forward, GRPO loss, backward) on one batch of
    random samples, one per completion length (prompt_len + length - 1 positions each)."""
    torch.manual_seed(0)
    model = MoEForCausalLM(cfg)
    trainer = Trainer(model, TrainerConfig(), pad_id=0)
    g = torch.Generator().manual_seed(1)
    V = cfg.vocab_size

    def tokens(n: int) -> list[int]:
        return torch.randint(1, V, (n,), generator=g).tolist()

    samples = [Sample(tokens(prompt_len), tokens(n), [-1.0] * n, [0] * n, reward=float(i % 2))
               for i, n in enumerate(completion_lens)]  # fmt: skip
    t = collate(samples, 0, torch.device("cpu"))
    extra = {"adv_BT": torch.randn(t["behaviour_BT"].shape, generator=g)}
    num_real = int(t["valid_BT"].sum())
    return count_ops(lambda: trainer._forward_backward(t, extra, None, None, num_real))


@pytest.mark.slow
def test_mid_forward_backward_ops_and_no_host_sync() -> None:
    counted = trainer_step_ops(ModelConfig(**MID), prompt_len=64, completion_lens=[193, 193])
    print(f"mid fwd+bwd 2x256: {counted.ops} aten ops ({counted.kernels} not views), "
          f"{counted.syncs} host syncs")  # fmt: skip
    assert counted.syncs == 0, f"host syncs in the trainer step: {counted.sync_ops()}"
    assert counted.ops <= MAX_OPS, f"{counted.ops} ops > {MAX_OPS}; top: {counted.top(20)}"


def test_small_forward_backward_has_no_host_sync_with_padding() -> None:
    """The same on a small model with right padding (unequal lengths: the packed path)."""
    cfg = ModelConfig(**{**MID, "vocab_size": 512, "hidden_size": 64, "num_hidden_layers": 2,
                         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                         "moe_intermediate_size": 32, "num_experts": 8})  # fmt: skip
    counted = trainer_step_ops(cfg, prompt_len=5, completion_lens=[7, 3, 5])
    assert counted.syncs == 0, f"host syncs in the trainer step: {counted.sync_ops()}"
