"""Running the model's MoE block expert-parallel, from outside src/slipstream/model.

Shape legend: B batch, T tokens per sequence, N = B*T tokens on this rank, D hidden, K top-k,
M rows received for local experts, E experts (global), R EP world size.

`ExpertParallelExperts` is an `Experts` module that holds only this rank's E / R experts (same
layout, same parameter names) and whose forward takes the block's routing for *global* expert
ids: it dispatches each (token, expert) assignment to the rank owning the expert through a
`Dispatcher`, runs the local experts with the model's own grouped path, and combines the
weighted outputs back at the token's source rank. Put in place of a `SparseMoeBlock`'s
`experts`, the block (router, shared expert, aux losses) is unchanged, so the same model code
runs replicated or expert-parallel.

- `ExpertParallelExperts.from_full(experts, dispatcher)` copies this rank's experts out of a full
  module (tests, benchmarks); the trainer builds them on the meta device and loads its shard
  (slipstream.parallel).
- Its parameters may be DTensors (placed on the EP mesh and FSDP2-sharded): the forward computes
  with their local parts (`Experts.weights`), which is what FSDP unshards to for the forward.
- Autograd: a rank that receives no rows still takes part in backward's all-to-alls (the
  Dispatcher contract) and still gives its expert weights a (zero) gradient, so every rank's
  FSDP reduce-scatter sees the same parameters.

Not covered: loading per-rank expert shards straight from a checkpoint here (parallel/ does),
gradient synchronisation of the replicated router (a data-parallel concern: FSDP does it).
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from slipstream.model.expert_activation import Activation
from slipstream.model.moe_block import Experts, SparseMoeBlock
from slipstream.moe.base import Dispatcher


class ExpertParallelExperts(Experts):
    """This EP rank's experts; forward(x_ND, ids_NK, w_NK) takes global expert ids."""

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        dispatcher: Dispatcher,
        activation: Activation | None = None,
        bias: bool = False,
    ) -> None:
        topo = dispatcher.group.topo
        if num_experts != topo.num_experts:
            raise ValueError(
                f"experts module has {num_experts} experts, topology {topo.num_experts}"
            )
        super().__init__(topo.experts_per_rank, hidden_size, intermediate_size, activation, bias)
        self.num_global_experts = num_experts
        self.dispatcher = dispatcher

    @classmethod
    def from_full(cls, experts: Experts, dispatcher: Dispatcher) -> ExpertParallelExperts:
        """A copy of the experts `dispatcher.group.rank` owns, out of a full module."""
        lo, hi = dispatcher.group.topo.expert_range(dispatcher.group.rank)
        d = experts.down_proj.shape[1]
        local = cls(experts.num_experts, d, experts.intermediate_size, dispatcher,
                    experts.activation, experts.gate_up_proj_bias is not None)  # fmt: skip
        local = local.to(experts.gate_up_proj.device, experts.gate_up_proj.dtype)
        _copy_expert_rows(local, experts, lo, hi)
        return local

    def forward(
        self, x_ND: torch.Tensor, ids_NK: torch.Tensor, w_NK: torch.Tensor, impl: str = "grouped"
    ) -> torch.Tensor:
        recv_x_MD, recv_local_M, handle = self.dispatcher.dispatch(x_ND, ids_NK, w_NK)
        y_MD = self.local_forward(recv_x_MD, recv_local_M, impl)
        # a fresh tensor, not combine's view: FSDP2 hooks a wrapped module's output for backward
        return self.dispatcher.combine(y_MD, handle).clone()

    def local_forward(
        self, recv_x_MD: torch.Tensor, recv_local_M: torch.Tensor, impl: str = "grouped"
    ) -> torch.Tensor:
        """Per-row outputs of the local experts (each row has one expert, weight 1). Stays
        connected to recv_x's graph and to the weights also with zero rows (see the module
        docstring)."""
        if recv_x_MD.shape[0] == 0:
            touched = sum(t.sum() for t in (*self.weights(), *self.biases()) if t is not None)
            return recv_x_MD.clone() + 0.0 * touched
        ones_M1 = recv_x_MD.new_ones((recv_x_MD.shape[0], 1))
        return super().forward(recv_x_MD, recv_local_M[:, None], ones_M1, impl=impl)


def expert_parallel(block: SparseMoeBlock, dispatcher: Dispatcher) -> SparseMoeBlock:
    """Make `block` expert-parallel in place: its experts become this rank's share (copied out
    of the full set, which is then no longer referenced); returns the block."""
    block.experts = ExpertParallelExperts.from_full(block.experts, dispatcher)
    return block


class ExpertParallelMoE(nn.Module):
    """A `SparseMoeBlock` made expert-parallel (`expert_parallel`), as a module of its own:
    forward(x_BTD) -> (output (B, T, D), router logits (B*T, E)); `local_experts` are this
    rank's experts. Kept for the benchmarks' and tests' call sites; new code uses
    `expert_parallel`."""

    def __init__(self, block: SparseMoeBlock, dispatcher: Dispatcher) -> None:
        super().__init__()
        # A new block sharing the router and shared expert with `block`, which stays as it was.
        twin = copy.copy(block)
        twin._modules = dict(block._modules)
        self.block = expert_parallel(twin, dispatcher)

    @property
    def local_experts(self) -> ExpertParallelExperts:
        return self.block.experts  # type: ignore[return-value]

    @property
    def dispatcher(self) -> Dispatcher:
        return self.local_experts.dispatcher

    def forward(self, x_BTD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.block(x_BTD)


def shard_experts(experts: Experts, group) -> Experts:  # noqa: ANN001 - EPGroup
    """A plain `Experts` holding (copies of) the experts `group.rank` owns."""
    if experts.num_experts != group.topo.num_experts:
        raise ValueError(
            f"experts module has {experts.num_experts} experts, topology {group.topo.num_experts}"
        )
    lo, hi = group.topo.expert_range(group.rank)
    local = Experts(hi - lo, experts.down_proj.shape[1], experts.intermediate_size,
                    experts.activation, experts.gate_up_proj_bias is not None)  # fmt: skip
    local = local.to(experts.gate_up_proj.device, experts.gate_up_proj.dtype)
    _copy_expert_rows(local, experts, lo, hi)
    return local


def _copy_expert_rows(local: Experts, full: Experts, lo: int, hi: int) -> None:
    """Experts [lo, hi) of `full` (weights and biases) into `local`."""
    with torch.no_grad():
        for name in ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias"):
            src = getattr(full, name)
            if src is not None:
                getattr(local, name).copy_(src[lo:hi])


def run_local_experts(
    experts: Experts, recv_x_MD: torch.Tensor, recv_local_M: torch.Tensor, impl: str = "grouped"
) -> torch.Tensor:
    """Per-row outputs of local experts (each row has one expert, weight 1); connected to
    recv_x's graph also with zero rows."""
    if recv_x_MD.shape[0] == 0:
        return recv_x_MD.clone()
    ones_M1 = recv_x_MD.new_ones((recv_x_MD.shape[0], 1))
    return experts(recv_x_MD, recv_local_M[:, None], ones_M1, impl=impl)
