"""The `Dispatcher` protocol for expert-parallel (EP) MoE token exchange, and its factory.

Shape legend: N tokens on this rank, D hidden, K experts per token (top-k), M token-expert rows
received by this rank for its local experts, R EP world size, E experts (global).

Contract (every implementation):
- `dispatch(x_ND, topk_idx_NK, topk_w_NK) -> (recv_x_MD, recv_expert_idx_M, handle)`: sends each
  (token, expert) assignment to the rank owning the expert; `recv_expert_idx_M` are LOCAL expert
  indices in [0, E / R). Row order of recv_x is implementation-defined.
- `combine(y_MD, handle) -> out_ND`: y_MD are the expert outputs for recv_x_MD row by row;
  returns out[n] = sum_j topk_w[n, j] * y(token n, expert topk_idx[n, j]) at the token's source
  rank. Assignments a dispatcher dropped (padded, over capacity) contribute 0 and are counted.
- Collective: every rank of the EP group calls dispatch, then combine, in the same order.
- Autograd: gradients flow to x, topk_w and (through y) the expert weights; backward issues the
  mirrored all-to-alls, so y_MD must stay connected to recv_x_MD's graph whenever gradients are
  needed (even with M = 0) - otherwise some ranks would skip a collective and the group hangs.
  `combine` refuses a detached y in that case.
- Every call reports its sends to `self.meter` (see meter.py).
Not covered: expert load balancing / capacity planning beyond the padded dispatcher's fixed
capacity, overlapping communication with compute, FP8 dispatch.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from slipstream.moe.comm import Channel
from slipstream.moe.meter import ByteMeter
from slipstream.moe.rank_layout import EPGroup

DISPATCHER_TYPES = {
    "padded": "slipstream.moe.padded:PaddedDispatcher",
    "exact": "slipstream.moe.exact:ExactDispatcher",
    "hierarchical": "slipstream.moe.hierarchical:HierarchicalDispatcher",
    "deepep": "slipstream.moe.deepep:DeepEPDispatcher",  # needs deep_ep + CUDA; never run here
}


@runtime_checkable
class Dispatcher(Protocol):
    group: EPGroup
    meter: ByteMeter

    def dispatch(
        self, x_ND: torch.Tensor, topk_idx_NK: torch.Tensor, topk_w_NK: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, Any]: ...

    def combine(self, y_MD: torch.Tensor, handle: Any) -> torch.Tensor: ...


@dataclass
class HandleBase:
    num_tokens: int
    needs_grad: bool


class BaseDispatcher:
    """Shared plumbing: the world channel, input checks, the detached-y guard."""

    type: str = "base"

    def __init__(self, group: EPGroup, meter: ByteMeter | None = None) -> None:
        self.group = group
        self.topo = group.topo
        self.meter = meter if meter is not None else ByteMeter()
        self.world = Channel(
            group.world, range(self.topo.world_size), self.topo, group.rank, self.meter
        )
        self.first_expert = self.topo.expert_range(group.rank)[0]

    def _check(self, x_ND: torch.Tensor, idx_NK: torch.Tensor, w_NK: torch.Tensor) -> None:
        if x_ND.dim() != 2 or idx_NK.dim() != 2 or idx_NK.shape != w_NK.shape:
            raise ValueError(
                f"{self.type} dispatch: expected x (N, D), topk_idx (N, K), topk_w (N, K); got "
                f"{tuple(x_ND.shape)}, {tuple(idx_NK.shape)}, {tuple(w_NK.shape)}"
            )
        if idx_NK.shape[0] != x_ND.shape[0]:
            raise ValueError(f"x has {x_ND.shape[0]} tokens but topk_idx has {idx_NK.shape[0]}")
        if idx_NK.numel() and (idx_NK.min() < 0 or idx_NK.max() >= self.topo.num_experts):
            raise ValueError(
                f"topk_idx outside [0, {self.topo.num_experts}): "
                f"min {int(idx_NK.min())}, max {int(idx_NK.max())}"
            )

    @staticmethod
    def _needs_grad(*ts: torch.Tensor) -> bool:
        return torch.is_grad_enabled() and any(t.requires_grad for t in ts)

    def _check_y(self, y_MD: torch.Tensor, handle: HandleBase, num_rows: int) -> None:
        if y_MD.shape[0] != num_rows:
            raise ValueError(
                f"{self.type} combine: y has {y_MD.shape[0]} rows, expected {num_rows}"
            )
        if handle.needs_grad and torch.is_grad_enabled() and not y_MD.requires_grad:
            raise RuntimeError(
                f"{self.type} combine: y_MD does not require grad but dispatch's outputs do; "
                "backward would skip this rank's all-to-alls and hang the group. Keep y connected "
                "to recv_x (e.g. y = recv_x.clone() when M = 0)."
            )


def make_dispatcher(
    type: str, group: EPGroup, meter: ByteMeter | None = None, **options: Any
) -> Dispatcher:
    """Build the dispatcher named by `type` (see DISPATCHER_TYPES); `options` go to its
    constructor (e.g. capacity_factor for "padded")."""
    if type not in DISPATCHER_TYPES:
        raise ValueError(f"dispatcher type={type!r}; expected one of {sorted(DISPATCHER_TYPES)}")
    mod, cls = DISPATCHER_TYPES[type].split(":")
    return getattr(importlib.import_module(mod), cls)(group, meter, **options)
