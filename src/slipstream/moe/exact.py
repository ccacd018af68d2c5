"""`exact` dispatcher: one all-to-all over the EP world with exact split sizes.

Shape legend: N tokens here, D hidden, K top-k, A = N*K assignments, M rows received, R ranks.

dispatch: sort the A (token, expert) assignments by global expert id (hence by owner rank),
exchange the per-rank counts with an all_to_all_single of R int64s, then send one copy of the
token per assignment (a token with two experts on the same rank is sent twice - the plain
Megatron-style all-to-all baseline) together with its expert id (int32). combine sends the A
outputs back with the splits swapped and takes the routing-weighted sum at the source.
No node awareness: a token with j experts on a remote node crosses the inter-node link j times.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from slipstream.model.moe_block import combine_topk
from slipstream.moe.base import BaseDispatcher, HandleBase


@dataclass
class ExactHandle(HandleBase):
    order_A: torch.Tensor
    send_counts: list[int]
    recv_counts: list[int]
    topk_w_NK: torch.Tensor


class ExactDispatcher(BaseDispatcher):
    type = "exact"

    def dispatch(
        self, x_ND: torch.Tensor, topk_idx_NK: torch.Tensor, topk_w_NK: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, ExactHandle]:
        self._check(x_ND, topk_idx_NK, topk_w_NK)
        self.meter.start_call("dispatch")
        N, K = topk_idx_NK.shape
        flat_e_A = topk_idx_NK.reshape(-1)
        order_A = torch.argsort(flat_e_A, stable=True)
        dest_A = self.topo.owner_rank(flat_e_A)
        send = torch.bincount(dest_A, minlength=self.topo.world_size).tolist()
        recv = self.world.exchange_counts(send, "dispatch", x_ND.device)
        x_AD = x_ND.index_select(0, order_A // K)
        recv_x_MD = self.world.send(x_AD, send, recv, "dispatch", "payload")
        # expert ids travel as int32 (E < 2^31): half the metadata of int64
        ids_A = flat_e_A[order_A].to(torch.int32)
        recv_e_M = self.world.send(ids_A, send, recv, "dispatch", "meta").long()
        handle = ExactHandle(N, self._needs_grad(x_ND, topk_w_NK), order_A, send, recv, topk_w_NK)
        return recv_x_MD, recv_e_M - self.first_expert, handle

    def combine(self, y_MD: torch.Tensor, handle: ExactHandle) -> torch.Tensor:
        self._check_y(y_MD, handle, sum(handle.recv_counts))
        self.meter.start_call("combine")
        back_AD = self.world.send(
            y_MD, handle.recv_counts, handle.send_counts, "combine", "payload"
        )
        inverse_A = torch.empty_like(handle.order_A)
        inverse_A[handle.order_A] = torch.arange(handle.order_A.numel(), device=y_MD.device)
        N, K = handle.topk_w_NK.shape
        y_NKD = back_AD.index_select(0, inverse_A).view(N, K, y_MD.shape[1])
        return combine_topk(handle.topk_w_NK, y_NKD)
