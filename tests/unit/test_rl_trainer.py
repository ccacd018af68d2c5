"""Trainer on a real tiny MoE model: GRPO moves probability to rewarded completions, PPO runs,
state round-trips, and 2-process gloo data parallelism equals the single-process step."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from slipstream.config.model import ModelConfig
from slipstream.config.rl import TrainerConfig
from slipstream.model import MoEForCausalLM
from slipstream.rl.trainer import Trainer, lr_factor
from slipstream.rl.types import Batch, Group, Sample, TaskRef
from slipstream.runtime import exit_distributed_process


def tiny_model(seed: int = 0, aux: float = 0.001) -> MoEForCausalLM:
    torch.manual_seed(seed)
    return MoEForCausalLM(
        ModelConfig(
            vocab_size=16,
            hidden_size=16,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=8,
            intermediate_size=32,
            moe_intermediate_size=16,
            num_experts=4,
            num_experts_per_tok=2,
            max_position_embeddings=32,
            router_aux_loss_coef=aux,
        )  # fmt: skip
    )


def make_batch(num_groups: int = 2) -> Batch:
    groups = []
    for n in range(num_groups):
        samples = [
            Sample([1, 2 + n], [5, 6], [-2.0, -2.0], [0, 0], reward=1.0),
            Sample([1, 2 + n], [7], [-2.0], [0], reward=0.0),
            Sample([1, 2 + n], [7, 8, 9], [-2.0, -2.5, -3.0], [0, 0, 0], reward=0.0),
            Sample([1, 2 + n], [5, 9], [-2.0, -1.0], [0, 0], reward=1.0),
        ]
        groups.append(Group(task=TaskRef(n, n), samples=samples))
    return Batch(groups=groups, trainer_version=0)


def logp_of(model: MoEForCausalLM, prompt: list[int], tok: int) -> float:
    with torch.no_grad():
        out = model(torch.tensor([prompt]))
    return torch.log_softmax(out.logits_BTV[0, -1], -1)[tok].item()


@pytest.mark.parametrize("loss", ["grpo", "ppo"])
def test_rewarded_completion_gains_probability(loss: str) -> None:
    model = tiny_model()
    cfg = TrainerConfig(lr=1e-2, loss=loss, kl_coef=0.01, entropy_coef=0.001, num_minibatches=2)
    trainer = Trainer(model, cfg, pad_id=0)
    before = logp_of(model, [1, 2], 5) - logp_of(model, [1, 2], 7)
    for _ in range(8):
        metrics = trainer.step(make_batch())
    after = logp_of(model, [1, 2], 5) - logp_of(model, [1, 2], 7)
    assert after > before + 0.5
    assert trainer.version == 8
    for key in (
        "loss",
        "pg_loss",
        "clip_frac",
        "is_ratio_mean",
        "is_truncated_frac",
        "grad_norm",
        "kl",
    ):
        assert key in metrics
    if loss == "ppo":
        assert "value_loss" in metrics


def test_lr_schedule_and_state_roundtrip() -> None:
    cfg = TrainerConfig(lr=1.0, warmup_steps=2, lr_schedule="cosine", steps=10, min_lr_ratio=0.1)
    assert [round(lr_factor(s, cfg), 3) for s in (0, 1, 2, 10)] == [0.5, 1.0, 1.0, 0.1]
    a = Trainer(tiny_model(), TrainerConfig(lr=1e-2), pad_id=0)
    a.step(make_batch())
    state = a.state_dict()
    b = Trainer(tiny_model(seed=5), TrainerConfig(lr=1e-2), pad_id=0)
    b.load_state_dict(state)
    la, lb = a.step(make_batch())["loss"], b.step(make_batch())["loss"]
    assert la == lb and b.version == 2


def test_lr_schedule_counts_batches_with_several_minibatches() -> None:
    """trainer.steps counts batches: with 2 minibatches per batch the cosine is halfway after
    half the batches (it once counted optimizer steps and hit its floor halfway through)."""
    cfg = TrainerConfig(lr=1.0, lr_schedule="cosine", steps=4, min_lr_ratio=0.1, num_minibatches=2)
    trainer = Trainer(tiny_model(), cfg, pad_id=0)
    lrs = [trainer.step(make_batch())["lr"] for _ in range(4)]
    assert [round(x, 3) for x in lrs] == [round(lr_factor(s, cfg), 3) for s in (1, 2, 3, 4)]
    assert round(lrs[1], 3) == 0.55  # cosine midpoint of 1.0 -> 0.1


def _dp_worker(rank: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    model = tiny_model(aux=0.0)
    trainer = Trainer(model, TrainerConfig(lr=1e-2, aggregation="seq_mean"), pad_id=0)
    for _ in range(2):
        trainer.step(make_batch(4))
    torch.save(model.state_dict(), os.path.join(out_dir, f"rank{rank}.pt"))
    exit_distributed_process(0)  # a plain return can abort in gloo's teardown (see the module)


def test_two_process_gloo_matches_single_process(tmp_path: Path) -> None:
    mp.spawn(_dp_worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    r0 = torch.load(tmp_path / "rank0.pt")
    r1 = torch.load(tmp_path / "rank1.pt")
    single = tiny_model(aux=0.0)
    trainer = Trainer(single, TrainerConfig(lr=1e-2, aggregation="seq_mean"), pad_id=0)
    for _ in range(2):
        trainer.step(make_batch(4))
    moved = False
    for k, v in single.state_dict().items():
        assert torch.equal(r0[k], r1[k]), k
        torch.testing.assert_close(r0[k], v, rtol=1e-4, atol=1e-5)
        moved |= not torch.equal(v, tiny_model(aux=0.0).state_dict()[k])
    assert moved


def test_batch_without_signal_skips_the_optimizer_step() -> None:
    model = tiny_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    batch = make_batch()
    for g in batch.groups:
        for s in g.samples:
            s.reward = 1.0  # all equal: every GRPO advantage is zero
    trainer = Trainer(model, TrainerConfig(lr=1e-2), pad_id=0)
    metrics = trainer.step(batch)
    assert metrics["skipped"] == 1.0 and trainer.version == 1
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    trainer = Trainer(model, TrainerConfig(lr=1e-2, skip_no_signal=False), pad_id=0)
    assert trainer.step(batch)["skipped"] == 0.0
    assert any(not torch.equal(v, before[k]) for k, v in model.state_dict().items())  # aux loss


def test_freeze_router_keeps_router_weights_and_trains_the_rest() -> None:
    model = tiny_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = Trainer(model, TrainerConfig(lr=1e-2, freeze_router=True), pad_id=0)
    assert trainer.frozen == ["model.layers.0.mlp.gate.weight"]
    trainer.step(make_batch())
    after = model.state_dict()
    for k, v in after.items():
        if k in trainer.frozen:
            assert torch.equal(v, before[k]), k
    assert not torch.equal(after["lm_head.weight"], before["lm_head.weight"])
    # the router is still trainable without the option
    model2 = tiny_model()
    Trainer(model2, TrainerConfig(lr=1e-2), pad_id=0).step(make_batch())
    assert not torch.equal(model2.state_dict()["model.layers.0.mlp.gate.weight"],
                           before["model.layers.0.mlp.gate.weight"])  # fmt: skip


def test_collate_fills_every_field_per_position() -> None:
    """The trainer's right-padded batch, position by position: a fully sampled completion, a
    multi-turn one (an observation token in the middle, loss_mask 0) and a short one."""
    from slipstream.rl.trainer import collate

    full = Sample(prompt_ids=[5, 6], completion_ids=[7, 8, 9], behaviour_logprobs=[-1.0, -2.0, -3.0],
                  versions=[4, 4, 5], reward=1.0)  # fmt: skip
    turns = Sample(prompt_ids=[5], completion_ids=[7, 3, 8], behaviour_logprobs=[-1.5, -2.5],
                   versions=[2, 3], reward=0.0, loss_mask=[1, 0, 1])  # fmt: skip
    bare = Sample(
        prompt_ids=[5, 6, 6],
        completion_ids=[7],
        behaviour_logprobs=[-0.5],
        versions=[9],
        reward=0.0,
    )
    t = collate([full, turns, bare], pad_id=0, device=torch.device("cpu"))
    assert t["inputs_BT"].tolist() == [[5, 6, 7, 8], [5, 7, 3, 0], [5, 6, 6, 0]]
    assert t["targets_BT"].tolist() == [[6, 7, 8, 9], [7, 3, 8, 0], [6, 6, 7, 0]]
    assert t["mask_BT"].tolist() == [[False, True, True, True], [True, False, True, False],
                                     [False, False, True, False]]  # fmt: skip
    assert t["behaviour_BT"].tolist() == [[0.0, -1.0, -2.0, -3.0], [-1.5, 0.0, -2.5, 0.0],
                                          [0.0, 0.0, -0.5, 0.0]]  # fmt: skip
    # prompt positions: the first sampled token's version; the observation: the next sampled one's
    assert t["version_BT"].tolist() == [[4, 4, 4, 5], [2, 3, 3, -1], [9, 9, 9, -1]]
    assert t["valid_BT"].tolist() == [[True] * 4, [True, True, True, False],
                                      [True, True, True, False]]  # fmt: skip
    assert t["last_B"].tolist() == [3, 2, 2]
    assert collate([full], 0, torch.device("cpu"), pad_to=6)["inputs_BT"].shape == (1, 6)
    with pytest.raises(ValueError, match="pad_to"):
        collate([full], 0, torch.device("cpu"), pad_to=3)


@pytest.mark.parametrize("max_norm", [1e-3, 1e3])
def test_clip_grad_norm_equals_torch_bit_for_bit(max_norm: float) -> None:
    """Clipping (small max_norm) and not clipping (large): gradients and norm as torch's."""
    from slipstream.parallel.ranks import clip_grad_norm_

    torch.manual_seed(0)
    ours = [torch.nn.Parameter(torch.randn(7, 5)), torch.nn.Parameter(torch.randn(3))]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    for a, b in zip(ours, ref, strict=True):
        a.grad = torch.randn_like(a)
        b.grad = a.grad.clone()
    norm = clip_grad_norm_(ours, max_norm)
    ref_norm = torch.nn.utils.clip_grad_norm_(ref, max_norm)
    assert torch.equal(norm, ref_norm)
    for a, b in zip(ours, ref, strict=True):
        assert torch.equal(a.grad, b.grad)
