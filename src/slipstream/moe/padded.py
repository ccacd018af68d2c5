"""`padded` dispatcher: fixed-capacity all-to-all (static shapes), drops counted.

Shape legend: N tokens here, D hidden, K top-k, A = N*K assignments, R ranks, C capacity rows per
(source, destination) pair, M rows received (valid ones only).

Every rank sends exactly C rows to every rank (R*C*D elements per call, full or not), so the
message sizes are static - what CUDA-graph-friendly EP layers do. C = ceil(capacity_factor * N*K
/ R), or `capacity` if given; all ranks must end up with the same C (same N, or pass `capacity`).
Assignments beyond C for a destination are DROPPED (first come, first served in token order,
the same for all K slots): they contribute 0 to combine's output. Drops are counted per call
(`handle.num_dropped`, `handle.dropped_NK`) and in total (`dropped`, `assigned`).
recv_x is returned compacted to the valid rows (the padding is not handed to the experts).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from slipstream.model.moe_block import combine_topk
from slipstream.moe.base import BaseDispatcher, HandleBase
from slipstream.moe.meter import ByteMeter
from slipstream.moe.rank_layout import EPGroup

log = logging.getLogger(__name__)


@dataclass
class PaddedHandle(HandleBase):
    capacity: int
    kept_A: torch.Tensor  # assignment ids (token*K + slot) that were sent
    slot_kept: torch.Tensor  # their row in the padded (R*C) send buffer
    valid_rows: torch.Tensor  # rows of the received padded buffer that hold a token
    dropped_NK: torch.Tensor  # bool
    num_dropped: int
    topk_w_NK: torch.Tensor


class PaddedDispatcher(BaseDispatcher):
    type = "padded"

    def __init__(
        self,
        group: EPGroup,
        meter: ByteMeter | None = None,
        capacity_factor: float = 1.25,
        capacity: int | None = None,
    ) -> None:
        super().__init__(group, meter)
        if capacity is None and capacity_factor <= 0:
            raise ValueError(f"capacity_factor={capacity_factor} must be > 0")
        self.capacity_factor, self.capacity = capacity_factor, capacity
        self.dropped = 0
        self.assigned = 0

    def capacity_for(self, num_tokens: int, top_k: int) -> int:
        if self.capacity is not None:
            return self.capacity
        return max(1, math.ceil(self.capacity_factor * num_tokens * top_k / self.topo.world_size))

    def dispatch(
        self, x_ND: torch.Tensor, topk_idx_NK: torch.Tensor, topk_w_NK: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, PaddedHandle]:
        self._check(x_ND, topk_idx_NK, topk_w_NK)
        self.meter.start_call("dispatch")
        N, K = topk_idx_NK.shape
        R, C = self.topo.world_size, self.capacity_for(N, K)
        dev = x_ND.device
        flat_e_A = topk_idx_NK.reshape(-1)
        dest_A = self.topo.owner_rank(flat_e_A)
        order_A = torch.argsort(dest_A, stable=True)  # by destination, token order within
        counts_R = torch.bincount(dest_A, minlength=R)
        starts_R = torch.cumsum(counts_R, 0) - counts_R
        dest_sorted = dest_A[order_A]
        pos_A = torch.arange(order_A.numel(), device=dev) - starts_R[dest_sorted]
        keep = pos_A < C
        kept_A = order_A[keep]
        slot_kept = dest_sorted[keep] * C + pos_A[keep]
        dropped_A = torch.ones(N * K, dtype=torch.bool, device=dev)
        dropped_A[kept_A] = False
        num_dropped = int(N * K - kept_A.numel())
        self.dropped += num_dropped
        self.assigned += N * K
        if num_dropped and self.dropped == num_dropped:
            log.warning(
                "padded dispatcher: %d of %d assignments over capacity %d dropped (counted in "
                "dispatcher.dropped; raise capacity_factor to avoid)",
                num_dropped,
                N * K,
                C,
            )
        x_AD = x_ND.index_select(0, kept_A // K)
        buf_x = x_ND.new_zeros((R * C, x_ND.shape[1])).index_copy(0, slot_kept, x_AD)
        buf_e = torch.full((R * C,), -1, dtype=torch.int32, device=dev).index_copy(
            0, slot_kept, flat_e_A[kept_A].to(torch.int32)
        )
        even = [C] * R
        recv_x = self.world.send(buf_x, even, even, "dispatch", "payload")
        recv_e = self.world.send(buf_e, even, even, "dispatch", "meta").long()
        valid_rows = torch.nonzero(recv_e >= 0).squeeze(1)
        handle = PaddedHandle(
            N,
            self._needs_grad(x_ND, topk_w_NK),
            C,
            kept_A,
            slot_kept,
            valid_rows,
            dropped_A.view(N, K),
            num_dropped,
            topk_w_NK,
        )
        recv_local = recv_e.index_select(0, valid_rows) - self.first_expert
        return recv_x.index_select(0, valid_rows), recv_local, handle

    def combine(self, y_MD: torch.Tensor, handle: PaddedHandle) -> torch.Tensor:
        self._check_y(y_MD, handle, handle.valid_rows.numel())
        self.meter.start_call("combine")
        R, C = self.topo.world_size, handle.capacity
        buf = y_MD.new_zeros((R * C, y_MD.shape[1])).index_copy(0, handle.valid_rows, y_MD)
        even = [C] * R
        back = self.world.send(buf, even, even, "combine", "payload")
        N, K = handle.topk_w_NK.shape
        y_AD = y_MD.new_zeros((N * K, y_MD.shape[1])).index_copy(
            0, handle.kept_A, back.index_select(0, handle.slot_kept)
        )
        y_NKD = y_AD.view(N, K, y_MD.shape[1])
        return combine_topk(handle.topk_w_NK, y_NKD)
