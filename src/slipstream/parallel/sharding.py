"""The sharded policy: built on the meta device, placed on the meshes, FSDP2-wrapped, and only
this rank's shards materialised and read from the start checkpoint.

    model = build_sharded_model(checkpoint_dir, layout, meshes, ep_group, dispatcher, device, dtype)
    state = gather_full_state(model)        # collective; rank 0: the full internal state dict

- Experts (E / ep per EP rank) are `ExpertParallelExperts` (moe/layer.py) whose weights are
  DTensors placed `Shard(0)` on `meshes.ep`; `fully_shard` over `meshes.experts` then shards them
  over the dp_shard ranks (one global (E, ...) tensor sharded over both mesh dims).
- Each decoder layer is one FSDP2 unit over `meshes.dense` (attention, norms, router), the root
  another (embeddings, final norm, LM head); expert units are nested inside their layer's, so
  their parameters are not in the dense unit.
- Every FSDP2 unit sums gradients (divide factor 1): the Trainer normalises losses by global
  counts (parallel/ranks.py), so the sum is the batch's gradient.
- Loading reads only this rank's rows of each parameter (`RowReader`); no rank holds the full
  expert set or the full optimizer state at any time. `gather_full_state` is what publishing and
  export use: rank 0 then holds one full copy of the weights (not the optimizer) in memory.

- `param_dtype` (trainer.precision bf16/fp16): every unit's `MixedPrecisionPolicy(param_dtype,
  reduce_dtype=float32)`: the forward gathers parameters in that dtype, gradients are reduced
  in float32 into the float32 shards (the master weights the optimizer updates).

Not covered: tied embeddings across FSDP units (they stay in the root unit), parameters that are
not row-shardable (all of this model's are), CPU offload.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from slipstream.model import MoEForCausalLM, RowReader
from slipstream.model.moe_block import SparseMoeBlock
from slipstream.moe import make_dispatcher
from slipstream.moe.layer import ExpertParallelExperts
from slipstream.moe.rank_layout import EPGroup
from slipstream.parallel.layout import Layout, Meshes


def build_sharded_model(
    checkpoint_dir: str,
    layout: Layout,
    meshes: Meshes,
    ep_group: EPGroup | None,
    dispatcher: str,
    device: torch.device,
    dtype: torch.dtype,
    param_dtype: torch.dtype | None = None,
) -> MoEForCausalLM:
    """The policy of an HF-format checkpoint, sharded per the layout (collective).
    `param_dtype`: the compute dtype FSDP2 gathers parameters in (None: their own)."""
    with RowReader(checkpoint_dir, dtype=dtype) as reader:
        cfg = reader.config
        if layout.ep > 1 and cfg.num_experts % layout.ep:
            raise ValueError(
                f"trainer.parallel.ep = {layout.ep} does not divide the start checkpoint's "
                f"num_experts = {cfg.num_experts} ({checkpoint_dir})"
            )
        with torch.device("meta"):
            model = MoEForCausalLM(cfg).to(dtype)
        if layout.ep > 1:
            assert ep_group is not None
            _expert_parallel(model, ep_group, meshes, dispatcher, device)
        _fully_shard(model, meshes, param_dtype)
        model.to_empty(device=device)
        _load_rows(model, reader)
    model.tie_weights()
    return model


def _expert_parallel(model: MoEForCausalLM, group: EPGroup, meshes: Meshes, dispatcher: str,
                     device: torch.device) -> None:  # fmt: skip
    for layer in model.model.layers:
        block = layer.mlp
        if not isinstance(block, SparseMoeBlock):
            continue
        full = block.experts
        disp = make_dispatcher(dispatcher, group)
        with torch.device("meta"):
            experts = ExpertParallelExperts(
                full.num_experts, full.down_proj.shape[1], full.intermediate_size, disp,
                full.activation, full.gate_up_proj_bias is not None,
            ).to(dtype=full.gate_up_proj.dtype)  # fmt: skip
        for name in ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias"):
            local = getattr(experts, name)
            if local is None:
                continue
            placed = DTensor.from_local(local, meshes.ep, [Shard(0)], run_check=False)
            setattr(experts, name, nn.Parameter(placed))
        block.experts = experts


def _fully_shard(model: MoEForCausalLM, meshes: Meshes, param_dtype: torch.dtype | None) -> None:
    mp = MixedPrecisionPolicy()
    if param_dtype is not None:
        mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    units: list[FSDPModule] = []
    for layer in model.model.layers:
        if isinstance(layer.mlp, SparseMoeBlock):
            units.append(fully_shard(layer.mlp.experts, mesh=meshes.experts, mp_policy=mp))
        units.append(fully_shard(layer, mesh=meshes.dense, mp_policy=mp))
    units.append(fully_shard(model, mesh=meshes.dense, mp_policy=mp))
    for unit in units:
        unit.set_gradient_divide_factor(1.0)
        # a plain SUM (gloo has no PREMUL_SUM, which a divide factor otherwise uses)
        unit.set_force_sum_reduction_for_comms(True)


def owned_rows(param: torch.Tensor) -> tuple[int, int]:
    """[lo, hi) of the global dim-0 rows this rank holds of a dim-0-sharded DTensor (computed
    by distributing an index vector the same way; no communication)."""
    if not isinstance(param, DTensor):
        return 0, param.shape[0]
    index = torch.arange(param.shape[0], device=param.to_local().device)
    mine = distribute_tensor(index, param.device_mesh, param.placements, src_data_rank=None)
    rows = mine.to_local()
    if rows.numel() == 0:
        return 0, 0
    lo, hi = int(rows[0]), int(rows[-1]) + 1
    if hi - lo != rows.numel():
        raise RuntimeError(f"rows of a {tuple(param.shape)} shard are not contiguous")
    return lo, hi


@torch.no_grad()
def _load_rows(model: MoEForCausalLM, reader: RowReader) -> None:
    for name, param in model.named_parameters():
        local = param.to_local() if isinstance(param, DTensor) else param
        lo, hi = owned_rows(param)
        if hi == lo:
            continue
        rows = reader.rows(name, lo, hi)
        if tuple(rows.shape) != tuple(local.shape):
            raise ValueError(
                f"{name}: checkpoint rows [{lo}, {hi}) have shape {tuple(rows.shape)}, this "
                f"rank's shard {tuple(local.shape)}"
            )
        local.copy_(rows)
    # persistent buffers (a sigmoid router's e_score_correction_bias): replicated, and
    # `to_empty` left them uninitialised
    persistent = set(model.state_dict())
    for name, buf in model.named_buffers():
        if name in persistent:
            buf.copy_(reader.rows(name, 0, buf.shape[0]))


def gather_full_state(model: nn.Module, rank: int) -> dict[str, torch.Tensor] | None:
    """The full internal state dict (stacked experts) on rank 0 (CPU), None elsewhere.
    Collective: every rank calls it; parameters are gathered one at a time."""
    out: dict[str, torch.Tensor] = {}
    # DTensor warns at every gather of an expert weight that its two all-gathers (EP, then
    # expert-FSDP) cannot be merged into one: true, and what this layout costs; not news.
    redistribute_log = logging.getLogger("torch.distributed.tensor._redistribute")
    level = redistribute_log.level
    redistribute_log.setLevel(logging.ERROR)
    try:
        for name, t in model.state_dict().items():
            full = t.full_tensor() if isinstance(t, DTensor) else t
            if rank == 0:
                out[name] = full.detach().to("cpu", copy=True)
    finally:
        redistribute_log.setLevel(level)
    return out if rank == 0 else None


def sharded_param_bytes(model: nn.Module, optimizer: Any | None = None) -> dict[str, int]:
    """Bytes this rank holds: parameters, gradients and optimizer state (local shards),
    split into experts and the rest."""
    out = {"expert_param": 0, "dense_param": 0, "expert_grad": 0, "dense_grad": 0,
           "expert_optim": 0, "dense_optim": 0}  # fmt: skip

    def nbytes(t: torch.Tensor) -> int:
        local = t.to_local() if isinstance(t, DTensor) else t
        return local.numel() * local.element_size()

    kind = {}
    for name, p in model.named_parameters():
        k = "expert" if ".mlp.experts." in name else "dense"
        kind[id(p)] = k
        out[f"{k}_param"] += nbytes(p)
        if p.grad is not None:
            out[f"{k}_grad"] += nbytes(p.grad)
    if optimizer is not None:
        for p, st in optimizer.state.items():
            k = kind.get(id(p), "dense")
            out[f"{k}_optim"] += sum(
                nbytes(v) for v in st.values() if torch.is_tensor(v) and v.dim()
            )
    return out
