"""What a trainer rank needs to know about the others: its share of a batch, sums over ranks,
and how gradients come together. One class for a single process, whole-model replicas and the
sharded (FSDP2 + EP) layout, so the Trainer has one code path.

The Trainer normalises every loss term by *global* counts (tokens or sequences summed over all
ranks, `sum`), so each rank's loss is its share of the whole batch's loss and the gradient of
the batch is the SUM of the ranks' gradients: replicas all-reduce-sum them (`after_backward`),
FSDP2 reduce-scatters them with a divide factor of 1 (parallel/sharding.py). The MoE
load-balancing loss is computed from router statistics summed over ranks (`sum_keep_grad`:
forward all-reduce, identity backward, since every rank computes the same global value), so it
is the whole batch's loss, as in a single process. Result: N ranks take the step one process
would take on the same batch, up to float summation order.

Not covered: ranks that do not hold equal numbers of groups (the config requires
groups_per_step % num_processes == 0).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

T = TypeVar("T")


def clip_grad_norm_(params: Sequence[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """`torch.nn.utils.clip_grad_norm_` (one process), bit for bit, minus its unconditional pass
    over every gradient: torch multiplies by the clamped coefficient even when it is 1.0; here
    the gradients are scaled only when the norm exceeds max_norm (the same coefficient, computed
    the same way). -> the total norm before clipping. Not for DTensor gradients (Ranks does
    those)."""
    grads = [p.grad for p in params if p.grad is not None]
    total = torch.nn.utils.get_total_norm(grads)
    if bool(max_norm / (total + 1e-6) < 1.0):
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total


class _SumKeepGrad(torch.autograd.Function):
    """all_reduce(SUM) forward; identity backward: the upstream gradient is already the same
    global quantity on every rank."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        out = x.detach().clone()
        dist.all_reduce(out)
        return out

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return g


class Ranks:
    """This process among `world` trainer ranks. `sharded`: parameters are FSDP2 DTensors whose
    gradients FSDP reduces; otherwise each rank holds the whole model (world 1: one process)."""

    def __init__(
        self, world: int = 1, rank: int = 0, *, sharded: bool = False,
        device: torch.device | str = "cpu",
    ) -> None:  # fmt: skip
        """`device`: where collectives take their tensors (CUDA for NCCL, CPU for gloo)."""
        self.world, self.rank, self.sharded = world, rank, sharded
        self.device = torch.device(device)

    @classmethod
    def current(cls, sharded: bool, device: torch.device | str = "cpu") -> Ranks:
        """From the initialised default process group (one process when there is none)."""
        if not dist.is_initialized():
            return cls(device=device)
        return cls(dist.get_world_size(), dist.get_rank(), sharded=sharded, device=device)

    def share(self, items: Sequence[T]) -> list[T]:
        """This rank's share: items r, r + world, ... (len(items) must split evenly)."""
        if self.world == 1:
            return list(items)
        if len(items) % self.world:
            raise ValueError(f"{len(items)} groups do not split evenly over {self.world} ranks")
        return list(items[self.rank :: self.world])

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks (no gradient)."""
        if self.world == 1:
            return x
        out = x.detach().clone()
        dist.all_reduce(out)
        return out

    def max(self, x: torch.Tensor) -> torch.Tensor:
        if self.world == 1:
            return x
        out = x.detach().clone()
        dist.all_reduce(out, op=dist.ReduceOp.MAX)
        return out

    def sum_keep_grad(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks of a quantity every rank then uses identically (see the module)."""
        return x if self.world == 1 else _SumKeepGrad.apply(x)

    def after_backward(self, params: Sequence[torch.nn.Parameter]) -> None:
        """Replicas: sum the gradients over ranks (a parameter no token reached counts as a zero
        gradient, so every rank all-reduces the same list). Sharded: FSDP already did."""
        if self.world == 1 or self.sharded:
            return
        # one all-reduce of every gradient laid end to end per dtype: a collective per tensor
        # costs a gloo round trip each (47 per step on the quickstart model: 103 ms vs 14-16 ms
        # flat, docs/performance.md)
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
        for grads in by_dtype.values():
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat)
            for g, part in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
                g.copy_(part.view_as(g))

    def clip_grad_norm_(self, params: Sequence[torch.nn.Parameter], max_norm: float) -> float:
        """Scale gradients so their global L2 norm is at most max_norm; -> the norm before.
        Sharded: every element of every parameter lives on exactly one rank, so the global norm
        is the square root of the ranks' summed local squares."""
        if not self.sharded:
            return float(clip_grad_norm_(params, max_norm))
        grads = [p.grad for p in params if p.grad is not None]
        local_sq = torch.zeros((), dtype=torch.float64, device=self.device)
        for g in grads:
            local = g.to_local() if isinstance(g, DTensor) else g
            local_sq += local.detach().double().pow(2).sum().to(self.device)
        norm = float(self.sum(local_sq).sqrt())
        coef = max_norm / (norm + 1e-6)
        if coef < 1.0:
            for g in grads:
                (g.to_local() if isinstance(g, DTensor) else g).mul_(coef)
        return norm

    def reduce_metrics(
        self, metrics: dict[str, float], summed: Sequence[str] = (), maxed: Sequence[str] = ()
    ) -> dict[str, float]:
        """Metrics over ranks: `summed` keys added (partial sums of the batch's quantity), keys
        ending in `_max` or in `maxed` maxed, the rest averaged. Every rank must pass the same
        keys."""
        if self.world == 1:
            return dict(metrics)
        keys = sorted(metrics)
        add = [k for k in keys if k in summed]
        top = [k for k in keys if (k.endswith("_max") or k in maxed) and k not in add]
        mean = [k for k in keys if k not in add and k not in top]
        out = dict(metrics)
        for names, op, div in ((add, dist.ReduceOp.SUM, 1), (top, dist.ReduceOp.MAX, 1),
                               (mean, dist.ReduceOp.SUM, self.world)):  # fmt: skip
            if not names:
                continue
            v = torch.tensor([metrics[k] for k in names], dtype=torch.float64, device=self.device)
            dist.all_reduce(v, op=op)
            out.update({k: x / div for k, x in zip(names, v.tolist(), strict=True)})
        return out

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        if self.world == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src)
        return box[0]
