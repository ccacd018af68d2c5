"""`hierarchical` dispatcher: node-aware two-hop exchange in the style of DeepEP normal kernels.

Shape legend: N tokens here, D hidden, K top-k, G nodes, P ranks per node, C1 token copies sent
on hop 1, R1 rows received on hop 1, C2 copies sent on hop 2, R2 rows received on hop 2, M
token-expert rows handed to the local experts.

dispatch
  hop 1 (inter-node, rail group = ranks with my local index on every node): each token goes ONCE
    to every node holding at least one of its K experts, to the rank on that node with my local
    index. With it travel its K expert ids (int32) and routing weights, masked (-1 / 0) to the
    experts of that node. A token whose experts are all on my node never leaves it (self copy).
  hop 2 (intra-node, node group): the hop-1 receiver forwards each row ONCE to every rank of the
    node that owns one of its experts, with ids/weights masked to that rank's experts.
  The final receiver expands each row to one row per local expert it names.
combine mirrors it: each rank sums the weighted outputs of its experts per hop-2 row (per-rank
partial sum), sends them back on hop 2; the hop-1 receiver sums per hop-1 row (per-node partial
sum) and sends ONE row per (token, node) back over the inter-node link; the source sums over
nodes. Routing weights are therefore applied at the expert side and travel (packed as K extra
columns beside the activations, in x's dtype) through a differentiable all-to-all, so topk_w gets
its gradient back the same way.
Inter-node payload per token = number of distinct REMOTE nodes among its experts, vs. the number
of remote experts for `exact`; see cost_model.py for the expectation under uniform routing.
On one machine the "nodes" are simulated groups of ranks (rank_layout.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from slipstream.moe.base import BaseDispatcher, HandleBase
from slipstream.moe.comm import Channel
from slipstream.moe.meter import ByteMeter
from slipstream.moe.rank_layout import EPGroup


@dataclass
class HierHandle(HandleBase):
    tok_C1: torch.Tensor  # source token of each hop-1 copy
    send1: list[int]
    recv1: list[int]
    row_C2: torch.Tensor  # hop-1 row each hop-2 copy came from
    send2: list[int]
    recv2: list[int]
    row_M: torch.Tensor  # hop-2 row of each expert row
    w_M: torch.Tensor  # routing weight of each expert row (differentiable)
    num_r1: int
    num_r2: int


def _fan_out(
    dest_XK: torch.Tensor, valid_XK: torch.Tensor, num_dest: int
) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """For rows X with K destinations each (valid ones only): one copy per distinct
    (row, destination), ordered by destination then row. -> (row of each copy, destination of
    each copy, copies per destination)."""
    X = dest_XK.shape[0]
    hit_YX = torch.zeros((num_dest, X), dtype=torch.bool, device=dest_XK.device)
    rows = torch.arange(X, device=dest_XK.device)[:, None].expand_as(dest_XK)
    hit_YX[dest_XK[valid_XK], rows[valid_XK]] = True
    dest_C, row_C = torch.nonzero(hit_YX, as_tuple=True)
    return row_C, dest_C, hit_YX.sum(1).tolist()


class HierarchicalDispatcher(BaseDispatcher):
    type = "hierarchical"

    def __init__(self, group: EPGroup, meter: ByteMeter | None = None) -> None:
        super().__init__(group, meter)
        if group.node_group is None or group.rail_group is None:
            raise ValueError("hierarchical dispatcher needs node/rail groups: use EPGroup.create")
        t = self.topo
        self.rail = Channel(group.rail_group, t.rail_ranks(group.local), t, group.rank, self.meter)
        self.node = Channel(group.node_group, t.node_ranks(group.node), t, group.rank, self.meter)

    def dispatch(
        self, x_ND: torch.Tensor, topk_idx_NK: torch.Tensor, topk_w_NK: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, HierHandle]:
        self._check(x_ND, topk_idx_NK, topk_w_NK)
        self.meter.start_call("dispatch")
        t, K = self.topo, topk_idx_NK.shape[1]
        D = x_ND.shape[1]
        w_NK = topk_w_NK.to(x_ND.dtype)
        # hop 1: one copy per (token, destination node), over the rail group
        node_NK = t.owner_node(topk_idx_NK)
        tok_C1, node_C1, send1 = _fan_out(
            node_NK, torch.ones_like(node_NK, dtype=torch.bool), t.num_nodes
        )
        on_node_C1K = node_NK.index_select(0, tok_C1) == node_C1[:, None]
        ids_C1K = torch.where(on_node_C1K, topk_idx_NK.index_select(0, tok_C1), -1)
        w_C1K = w_NK.index_select(0, tok_C1) * on_node_C1K
        recv1 = self.rail.exchange_counts(send1, "dispatch", x_ND.device)
        packed = torch.cat([x_ND.index_select(0, tok_C1), w_C1K], dim=1)
        r1 = self.rail.send(packed, send1, recv1, "dispatch", "payload", meta_cols=K)
        ids_R1K = self.rail.send(ids_C1K.to(torch.int32), send1, recv1, "dispatch", "meta").long()
        # hop 2: one copy per (hop-1 row, destination rank in my node), over the node group
        valid_R1K = ids_R1K >= 0
        local_R1K = torch.where(valid_R1K, t.owner_rank(ids_R1K) - t.rank_of(self.group.node, 0), 0)
        row_C2, local_C2, send2 = _fan_out(local_R1K, valid_R1K, t.ranks_per_node)
        on_rank_C2K = (local_R1K.index_select(0, row_C2) == local_C2[:, None]) & (
            valid_R1K.index_select(0, row_C2)
        )
        ids_C2K = torch.where(on_rank_C2K, ids_R1K.index_select(0, row_C2), -1)
        packed2 = r1.index_select(0, row_C2)
        packed2 = torch.cat([packed2[:, :D], packed2[:, D:] * on_rank_C2K], dim=1)
        recv2 = self.node.exchange_counts(send2, "dispatch", x_ND.device)
        r2 = self.node.send(packed2, send2, recv2, "dispatch", "payload", meta_cols=K)
        ids_R2K = self.node.send(ids_C2K.to(torch.int32), send2, recv2, "dispatch", "meta").long()
        # expand to one row per local expert
        row_M, slot_M = torch.nonzero(ids_R2K >= 0, as_tuple=True)
        recv_x_MD = r2[:, :D].index_select(0, row_M)
        w_M = r2[:, D:][row_M, slot_M]
        recv_local_M = ids_R2K[row_M, slot_M] - self.first_expert
        handle = HierHandle(
            x_ND.shape[0],
            self._needs_grad(x_ND, topk_w_NK),
            tok_C1,
            send1,
            recv1,
            row_C2,
            send2,
            recv2,
            row_M,
            w_M,
            sum(recv1),
            sum(recv2),
        )
        return recv_x_MD, recv_local_M, handle

    def combine(self, y_MD: torch.Tensor, handle: HierHandle) -> torch.Tensor:
        self._check_y(y_MD, handle, handle.row_M.numel())
        self.meter.start_call("combine")
        D = y_MD.shape[1]
        yw_MD = y_MD * handle.w_M.to(y_MD.dtype)[:, None]
        # per-rank partial sums, back over the node group
        p2 = y_MD.new_zeros((handle.num_r2, D)).index_add(0, handle.row_M, yw_MD)
        back2 = self.node.send(p2, handle.recv2, handle.send2, "combine", "payload")
        # per-node partial sums, back over the rail group (one row per (token, node))
        p1 = y_MD.new_zeros((handle.num_r1, D)).index_add(0, handle.row_C2, back2)
        back1 = self.rail.send(p1, handle.recv1, handle.send1, "combine", "payload")
        return y_MD.new_zeros((handle.num_tokens, D)).index_add(0, handle.tok_C1, back1)
