"""The trainer on CUDA: a bf16-autocast GRPO step moves probability to the rewarded completion
(as tests/unit/test_rl_trainer.py checks on the CPU) with float32 weights and optimizer; and a
1-GPU NCCL process group runs the collectives the trainer and the EP dispatchers issue.

What one GPU can show about NCCL: the trainer's all_reduce (SUM and MAX, float32 gradients and
float64 metrics, `Trainer.ranks.reduce_metrics`), the data-parallel batch broadcast
(broadcast_object_list) and the EP all_to_all_single (padded, exact and hierarchical
dispatchers equal the local expert computation) on CUDA tensors, world size 1. A Trainer step
with the NCCL group initialised runs too, but at world size 1 it issues no collective; several
ranks (NCCL between GPUs, NVLink, EFA) need more GPUs and are not covered.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from slipstream.config.rl import TrainerConfig
from slipstream.rl.trainer import Trainer
from unit.test_rl_trainer import make_batch, tiny_model

pytestmark = pytest.mark.gpu


def logp_gap(model: torch.nn.Module, device: torch.device) -> float:
    """log p(rewarded token 5) - log p(unrewarded token 7) after prompt [1, 2]."""
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([[1, 2]], device=device)).logits_BTV[0, -1], -1)
    return float(logp[5] - logp[7])


def test_bf16_grpo_step_on_cuda_learns(gpu, record) -> None:
    model = tiny_model().to(gpu)
    reference = copy.deepcopy(model)
    trainer = Trainer(model, TrainerConfig(lr=1e-2, precision="bf16"), pad_id=0, device=gpu)
    before = logp_gap(model, gpu)
    losses = []
    for _ in range(8):
        metrics = trainer.step(make_batch())
        losses.append(metrics["loss"])
        assert all(v == v and abs(v) != float("inf") for v in metrics.values()), metrics
    after = logp_gap(model, gpu)
    # fp32 master weights and optimizer state under autocast
    assert all(p.dtype == torch.float32 for p in model.parameters())
    state = trainer.optimizer.state[next(model.parameters())]
    assert state["exp_avg"].dtype == torch.float32 and state["exp_avg"].device.type == gpu.type
    # one fp32 step from the same start for comparison (recorded, not asserted: bf16 differs)
    fp32 = Trainer(reference, TrainerConfig(lr=1e-2), pad_id=0, device=gpu)
    fp32_loss = fp32.step(make_batch())["loss"]
    record(logp_gap_before=before, logp_gap_after=after, losses=losses,
           fp32_first_loss=fp32_loss, grad_norm=metrics["grad_norm"])  # fmt: skip
    assert after > before + 0.5


def _nccl_rank(rank: int, init_file: str, out_dir: str, on_cpu: bool) -> None:
    from slipstream.moe import EPGroup, make_dispatcher
    from slipstream.moe.layer import run_local_experts, shard_experts
    from slipstream.moe.selfcheck import _block

    device = torch.device("cpu" if on_cpu else "cuda", 0)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "gloo" if on_cpu else "nccl"
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=0, world_size=1)
    out: dict = {"backend": dist.get_backend()}
    # the trainer's gradient all_reduce (float32) and metric reductions (float64)
    g = torch.arange(6, dtype=torch.float32, device=device)
    dist.all_reduce(g)
    m = torch.tensor([0.5, 2.0], dtype=torch.float64, device=device)
    dist.all_reduce(m, op=dist.ReduceOp.MAX)
    out["all_reduce"] = (g.tolist(), m.tolist())
    # launch/dp.py's per-step batch broadcast
    box = [make_batch(2)]
    dist.broadcast_object_list(box, src=0, device=device)
    out["broadcast_groups"] = len(box[0].groups)
    # a trainer step with the group up, and its metric reduction over NCCL
    trainer = Trainer(tiny_model().to(device), TrainerConfig(lr=1e-2), pad_id=0, device=device)
    metrics = trainer.step(make_batch())
    out["step_loss"] = metrics["loss"]
    out["reduced"] = trainer.ranks.reduce_metrics(  # what Trainer.step reduces its metrics with
        {"loss": 1.5, "num_tokens": 10.0, "ratio_max": 2.0}, summed=("num_tokens",)
    )
    # EP all_to_all_single over NCCL: every dispatcher equals the local experts
    group = EPGroup.create(1, 1, 4)
    block = _block(16, 4, 2, 8, seed=0).to(device)
    x = torch.randn(10, 16, device=device)
    _logits, w, ids = block.route(x)
    with torch.no_grad():
        want = block.experts(x, ids, w)
        for typ in ("padded", "exact", "hierarchical"):
            opts = {"capacity": 20} if typ == "padded" else {}
            d = make_dispatcher(typ, group, **opts)
            recv_x, recv_local, handle = d.dispatch(x, ids, w)
            y = run_local_experts(shard_experts(block.experts, group), recv_x, recv_local)
            out[typ] = float((d.combine(y, handle) - want).abs().max())
    torch.save(out, os.path.join(out_dir, "nccl.pt"))
    dist.destroy_process_group()


def test_one_gpu_nccl_group_runs_the_trainers_collectives(gpu, record, tmp_path: Path) -> None:
    on_cpu = gpu.type != "cuda"
    mp.spawn(_nccl_rank, args=(str(tmp_path / "init"), str(tmp_path), on_cpu), nprocs=1)
    out = torch.load(tmp_path / "nccl.pt", weights_only=False)
    record(**out)
    assert out["backend"] == ("gloo" if on_cpu else "nccl")
    assert out["all_reduce"] == ([0.0, 1.0, 2.0, 3.0, 4.0, 5.0], [0.5, 2.0])
    assert out["broadcast_groups"] == 2
    assert out["step_loss"] == out["step_loss"]  # finite, not NaN
    assert out["reduced"] == {"loss": 1.5, "num_tokens": 10.0, "ratio_max": 2.0}
    for typ in ("padded", "exact", "hierarchical"):
        assert out[typ] < 1e-5, f"{typ} dispatcher over {out['backend']}: {out[typ]}"
