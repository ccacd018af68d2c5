"""Rank-side code of the parallel-trainer tests (tests/integration/test_rl_parallel.py): the
same synthetic batches trained by `build_trainer` on any layout; importable by spawned ranks
(`pythonpath = ["tests"]`)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch

from slipstream.config import load_config
from slipstream.model import MoEForCausalLM, save_pretrained
from slipstream.rl.trainer import build_trainer
from slipstream.rl.types import Batch, Group, Sample, TaskRef

# 8 experts (divisible by ep = 4), 2 MoE layers, the load-balancing loss on.
MODEL = [
    "model.vocab_size=40", "model.hidden_size=32", "model.num_hidden_layers=2",
    "model.num_attention_heads=2", "model.num_key_value_heads=1", "model.head_dim=16",
    "model.moe_intermediate_size=16", "model.num_experts=8", "model.num_experts_per_tok=2",
    "model.max_position_embeddings=64", "model.router_aux_loss_coef=0.01",
]  # fmt: skip
TRAIN = [
    "trainer.groups_per_step=4", "trainer.lr=0.01", "trainer.skip_no_signal=false",
    "rollout.group_size=4", "run.num_threads=1",
]  # fmt: skip


# The same sizes as a GLM-4.5 (glm4_moe family): sigmoid group-limited routing with a random
# correction bias, an ungated shared expert, a dense first layer, q/k/v biases, partial rotary.
GLM_MODEL = [
    *MODEL, "model.model_type=glm4_moe", "model.router_scheme=sigmoid_group_topk",
    "model.router_correction_bias=true", "model.n_group=2", "model.topk_group=1",
    "model.routed_scaling_factor=2.5", "model.shared_expert_intermediate_size=16",
    "model.shared_expert_gated=false", "model.mlp_only_layers=[0]", "model.num_hidden_layers=3",
    "model.attention_bias=true", "model.partial_rotary_factor=0.5",
    "model.router_aux_loss_coef=0.0",
]  # fmt: skip


def save_init(directory: Path, model: list[str] = MODEL) -> None:
    cfg = load_config(None, model)
    torch.manual_seed(0)
    policy = MoEForCausalLM(cfg.model)
    with torch.no_grad():  # random biases: a layout that drops one would not pass
        for name, t in policy.state_dict().items():
            if name.endswith("bias"):
                t.normal_(0.0, 0.3)
    save_pretrained(policy, directory)


def load_state(directory: Path) -> dict[str, torch.Tensor]:
    """The internal state dict of a saved checkpoint."""
    from slipstream.model import load_pretrained

    return load_pretrained(directory).state_dict()


def batches(num_steps: int, num_groups: int = 4, group_size: int = 4, seed: int = 0) -> list[Batch]:
    """Deterministic GRPO batches with uneven lengths and mixed rewards."""
    rng = random.Random(seed)
    out = []
    for step in range(num_steps):
        groups = []
        for g in range(num_groups):
            prompt = [1] + [rng.randrange(3, 40) for _ in range(rng.randrange(3, 9))]
            samples = []
            for i in range(group_size):
                n = rng.randrange(1, 10)
                samples.append(Sample(prompt, [rng.randrange(3, 40) for _ in range(n)],
                                      [-rng.uniform(0.5, 3.0) for _ in range(n)], [step] * n,
                                      reward=float((g + i + step) % 3 == 0)))  # fmt: skip
            groups.append(Group(TaskRef(step * num_groups + g, g), samples))
        out.append(Batch(groups, trainer_version=step, staleness=[0] * num_groups))
    return out


def train(init_dir: str, overrides: list[str], num_steps: int = 3) -> dict[str, Any]:
    """Train the synthetic batches on this rank's layout; rank 0 returns the per-step metrics
    and the full state after training (the others: their metrics only)."""
    cfg = load_config(None, [*MODEL, *TRAIN, *overrides])
    trainer = build_trainer(cfg, init_dir, torch.device("cpu"), pad_id=0)
    metrics = [trainer.step(b) for b in batches(num_steps)]
    state = trainer.full_state()
    return {"metrics": metrics, "state": state}


def train_and_save(init_dir: str, overrides: list[str], store_url: str, num_steps: int) -> dict:
    """Train the first num_steps batches, then checkpoint (every rank takes part)."""
    from slipstream.storage import open_stores

    cfg = load_config(None, [*MODEL, *TRAIN, *overrides, f"store.url={store_url}"])
    trainer = build_trainer(cfg, init_dir, torch.device("cpu"), pad_id=0)
    metrics = [trainer.step(b) for b in batches(num_steps)]
    coord = {"saved_by": trainer.ranks.world} if trainer.ranks.rank == 0 else None
    trainer.save(open_stores(cfg).checkpoints, coord, {})
    return {"metrics": metrics}


def resume_and_train(init_dir: str, overrides: list[str], store_url: str, step: int,
                     num_steps: int) -> dict:  # fmt: skip
    """Restore checkpoint `step` onto this layout and train batches step..num_steps-1."""
    from slipstream.storage import open_stores

    cfg = load_config(None, [*MODEL, *TRAIN, *overrides, f"store.url={store_url}"])
    trainer = build_trainer(cfg, init_dir, torch.device("cpu"), pad_id=0)
    coord, _ = trainer.restore(open_stores(cfg).checkpoints, step)
    assert trainer.step_count == step
    metrics = [trainer.step(b) for b in batches(num_steps)[step:]]
    return {"metrics": metrics, "state": trainer.full_state(), "coordinator": coord}
