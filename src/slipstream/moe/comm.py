"""Differentiable variable-split all-to-all over a process group, plus the split-count exchange.

Works with any torch.distributed backend that implements `all_to_all_single` (gloo on CPU here,
NCCL on GPUs). Rows are the first dimension; `send_counts[i]` rows go to the i-th rank of the
group (in group order), `recv_counts[i]` rows arrive from it.

Backward of an all-to-all is the all-to-all with the splits swapped, so gradients flow back to the
sender. All ranks must issue the same sequence of all-to-alls in forward and therefore, via
autograd, in backward: callers keep a single chain of them per dispatch/combine.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from slipstream.moe.meter import ByteMeter
from slipstream.moe.rank_layout import Topology


def _a2a(x: torch.Tensor, send: list[int], recv: list[int], group: Any) -> torch.Tensor:
    out = x.new_empty((sum(recv), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, send, recv, group):  # type: ignore[override]
        ctx.send, ctx.recv, ctx.group = send, recv, group
        return _a2a(x, send, recv, group)

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        return _a2a(g, ctx.recv, ctx.send, ctx.group), None, None, None


class Channel:
    """One process group seen from one rank: its members (global ranks, group order), the
    topology for link classification, and the meter every send is reported to."""

    def __init__(
        self, group: Any, peer_ranks: Sequence[int], topo: Topology, rank: int, meter: ByteMeter
    ) -> None:
        self.group, self.peers, self.topo, self.rank, self.meter = (
            group,
            list(peer_ranks),
            topo,
            rank,
            meter,
        )

    @property
    def size(self) -> int:
        return len(self.peers)

    def exchange_counts(
        self, send_counts: Sequence[int], phase: str, device: torch.device
    ) -> list[int]:
        """Tell every peer how many rows it will get from me; -> rows I will get from each.
        `device`: where the backend wants tensors (CUDA for NCCL, CPU for gloo)."""
        if len(send_counts) != self.size:
            raise ValueError(f"{len(send_counts)} send counts for a group of {self.size}")
        t = torch.tensor(list(send_counts), dtype=torch.int64, device=device)
        self.meter.add(phase, "meta", self.topo, self.rank, self.peers, [1] * self.size, 8)
        recv = torch.empty_like(t)
        dist.all_to_all_single(recv, t, group=self.group)
        return recv.tolist()

    def send(
        self,
        x: torch.Tensor,
        send_counts: Sequence[int],
        recv_counts: Sequence[int],
        phase: str,
        kind: str,
        meta_cols: int = 0,
    ) -> torch.Tensor:
        """All-to-all of the rows of `x` (autograd-aware). The last `meta_cols` columns of each
        row are metered as "meta" (e.g. routing weights packed beside the activations)."""
        send, recv = [int(c) for c in send_counts], [int(c) for c in recv_counts]
        if sum(send) != x.shape[0]:
            raise ValueError(f"send counts sum to {sum(send)} but x has {x.shape[0]} rows")
        row_elems = math.prod(x.shape[1:])
        esize = x.element_size()
        if meta_cols:
            self.meter.add(phase, "meta", self.topo, self.rank, self.peers, send, meta_cols * esize)
        self.meter.add(
            phase, kind, self.topo, self.rank, self.peers, send, (row_elems - meta_cols) * esize
        )
        return _AllToAll.apply(x, send, recv, self.group)
