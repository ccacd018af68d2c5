"""trainer.precision: bf16/fp16 compute over float32 master weights, the old trainer.bf16 key,
and the bf16 grouped experts (torch._grouped_mm, hand-written backward) against the float32
per-expert loop reference, outputs and gradients, on the CPU."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from slipstream.config.rl import TrainerConfig
from slipstream.model.moe_block import Experts
from slipstream.rl.trainer import Trainer
from unit.test_rl_trainer import logp_of, make_batch, tiny_model

# bf16 keeps 8 significant bits: one rounding is up to 2^-8 relative; a dot product over D terms
# of rounded inputs (and a second one over I) lands within a few of those of the fp32 value.
BF16_RTOL = 2e-2


def _rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.float() - ref).norm() / ref.norm())


@pytest.mark.parametrize("num_tokens", [3, 64, 300])
def test_bf16_grouped_experts_match_fp32_loop(num_tokens: int) -> None:
    torch.manual_seed(0)
    num_experts, hidden, width, k = 8, 64, 32, 2
    experts = Experts(num_experts, hidden, width)
    torch.nn.init.normal_(experts.gate_up_proj, std=0.1)
    torch.nn.init.normal_(experts.down_proj, std=0.1)
    x = torch.randn(num_tokens, hidden, requires_grad=True)
    w, ids = torch.softmax(torch.randn(num_tokens, num_experts), -1).topk(k)
    w = w.detach().requires_grad_(True)
    g = torch.randn(num_tokens, hidden)
    leaves = (x, w, experts.gate_up_proj, experts.down_proj)
    results = {}
    for impl, dtype in (("loop", torch.float32), ("grouped", torch.bfloat16)):
        for t in leaves:
            t.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            y = experts(x, ids, w, impl=impl)
        assert y.dtype == dtype
        (y.float() * g).sum().backward()
        results[impl] = [y.detach().float()] + [t.grad.clone() for t in leaves]
    # the master weights and their gradients stay float32
    assert experts.gate_up_proj.grad.dtype == torch.float32
    names = ("output", "grad x", "grad gate weights", "grad gate_up_proj", "grad down_proj")
    for name, got, ref in zip(names, results["grouped"], results["loop"], strict=True):
        assert _rel_err(got, ref) < BF16_RTOL, (name, _rel_err(got, ref))


def test_fp32_grouped_experts_equal_loop_with_empty_experts() -> None:
    torch.manual_seed(1)
    experts = Experts(16, 32, 16)
    torch.nn.init.normal_(experts.gate_up_proj, std=0.1)
    torch.nn.init.normal_(experts.down_proj, std=0.1)
    x = torch.randn(5, 32, requires_grad=True)
    ids = torch.tensor([[0, 3], [3, 5], [0, 5], [15, 3], [3, 0]])  # most experts get nothing
    w = torch.rand(5, 2, requires_grad=True)
    outs = {}
    for impl in ("grouped", "loop"):
        for t in (x, w, experts.gate_up_proj, experts.down_proj):
            t.grad = None
        y = experts(x, ids, w, impl=impl)
        y.square().sum().backward()
        outs[impl] = [y.detach(), x.grad, w.grad, experts.gate_up_proj.grad, experts.down_proj.grad]
    for got, ref in zip(outs["grouped"], outs["loop"], strict=True):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)


def test_bf16_key_is_read_as_precision() -> None:
    assert TrainerConfig(bf16=True).precision == "bf16"
    assert TrainerConfig(bf16=False).precision == "fp32"
    with pytest.raises(ValidationError, match="contradicts trainer.precision"):
        TrainerConfig(bf16=True, precision="fp16")
    with pytest.raises(ValidationError, match="precision"):
        TrainerConfig(precision="fp8")


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_low_precision_step_learns_with_fp32_master_weights(precision: str) -> None:
    model = tiny_model()
    trainer = Trainer(model, TrainerConfig(lr=1e-2, precision=precision), pad_id=0)
    before = logp_of(model, [1, 2], 5) - logp_of(model, [1, 2], 7)
    for _ in range(8):
        metrics = trainer.step(make_batch())
        assert all(v == v for v in metrics.values()), metrics
    after = logp_of(model, [1, 2], 5) - logp_of(model, [1, 2], 7)
    assert after > before + 0.5
    assert all(p.dtype == torch.float32 for p in model.parameters())
    state = trainer.optimizer.state[model.lm_head.weight]
    assert state["exp_avg"].dtype == torch.float32
    if precision == "fp16":
        assert trainer.scaler is not None and "grad_scale_skipped" in metrics


def test_activation_checkpointing_step_equals_plain_step() -> None:
    import copy

    model = tiny_model()
    states = []
    for ckpt in (False, True):
        m = copy.deepcopy(model)
        trainer = Trainer(m, TrainerConfig(lr=1e-2, activation_checkpointing=ckpt), pad_id=0)
        assert m.gradient_checkpointing is ckpt
        metrics = trainer.step(make_batch())
        states.append((metrics["loss"], m.state_dict()))
    assert states[1][0] == pytest.approx(states[0][0], rel=1e-6)
    for name, p in states[0][1].items():
        torch.testing.assert_close(states[1][1][name], p, rtol=1e-6, atol=1e-7)


def test_compile_blocks_needs_cuda() -> None:
    with pytest.raises(ValueError, match="compile_blocks"):
        Trainer(tiny_model(), TrainerConfig(compile_blocks=True), pad_id=0)
