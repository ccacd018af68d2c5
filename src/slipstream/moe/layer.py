"""Running the model's MoE block expert-parallel, from outside src/slipstream/model.

Shape legend: B batch, T tokens per sequence, N = B*T tokens on this rank, D hidden, K top-k,
M rows received for local experts.

`shard_experts` copies this rank's contiguous slice of a full `Experts` module into a smaller
`Experts` (E / R experts, same layout); `ExpertParallelMoE` wraps a `SparseMoeBlock`: the router
(and shared expert) stay replicated on every rank, routing is computed locally, tokens go through
a `Dispatcher`, the local experts run the model's own grouped path, and combine returns the
weighted sum. Not covered: loading per-rank expert shards straight from a checkpoint (this copies
from a full module), gradient synchronisation of the replicated router (a data-parallel concern).
"""

from __future__ import annotations

import torch
from torch import nn

from slipstream.model.moe import Experts, SparseMoeBlock
from slipstream.moe.base import Dispatcher
from slipstream.moe.topology import EPGroup


def shard_experts(experts: Experts, group: EPGroup) -> Experts:
    """A new `Experts` holding (copies of) the experts `group.rank` owns."""
    if experts.num_experts != group.topo.num_experts:
        raise ValueError(
            f"experts module has {experts.num_experts} experts, topology {group.topo.num_experts}"
        )
    lo, hi = group.topo.expert_range(group.rank)
    d = experts.down_proj.shape[1]
    local = Experts(hi - lo, d, experts.intermediate_size)
    with torch.no_grad():
        local.gate_up_proj.copy_(experts.gate_up_proj[lo:hi])
        local.down_proj.copy_(experts.down_proj[lo:hi])
    return local.to(experts.gate_up_proj.device, experts.gate_up_proj.dtype)


def run_local_experts(
    experts: Experts, recv_x_MD: torch.Tensor, recv_local_M: torch.Tensor, impl: str = "grouped"
) -> torch.Tensor:
    """Per-row outputs of the local experts (each row has one expert, weight 1). Always stays
    connected to recv_x's graph, also with zero rows (see the Dispatcher autograd contract)."""
    if recv_x_MD.shape[0] == 0:
        return recv_x_MD.clone()
    ones_M1 = recv_x_MD.new_ones((recv_x_MD.shape[0], 1))
    return experts(recv_x_MD, recv_local_M[:, None], ones_M1, impl=impl)


class ExpertParallelMoE(nn.Module):
    """Drop-in for `SparseMoeBlock.forward` with the experts sharded over the EP group."""

    def __init__(self, block: SparseMoeBlock, dispatcher: Dispatcher) -> None:
        super().__init__()
        # keep the replicated parts only; the full expert set is not referenced (memory)
        self.gate, self.shared_expert = block.gate, block.shared_expert
        self.shared_expert_gate = block.shared_expert_gate
        self.top_k, self.norm_topk_prob, self.impl = block.top_k, block.norm_topk_prob, block.impl
        self.dispatcher = dispatcher
        self.local_experts = shard_experts(block.experts, dispatcher.group)

    def forward(self, x_BTD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (output (B, T, D), router logits (B*T, E)), as SparseMoeBlock."""
        B, T, D = x_BTD.shape
        x_ND = x_BTD.reshape(-1, D)
        # the model's routing, unchanged (it only reads gate / top_k / norm_topk_prob)
        logits_NE, w_NK, ids_NK = SparseMoeBlock.route(self, x_ND)  # type: ignore[arg-type]
        recv_x, recv_local, handle = self.dispatcher.dispatch(x_ND, ids_NK, w_NK)
        y = run_local_experts(self.local_experts, recv_x, recv_local, self.impl)
        out_ND = self.dispatcher.combine(y, handle)
        se, seg = self.shared_expert, self.shared_expert_gate
        if se is not None and seg is not None:
            out_ND = out_ND + torch.sigmoid(seg(x_ND)) * se(x_ND)
        return out_ND.view(B, T, D), logits_NE
