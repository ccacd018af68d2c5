"""Counting the aten ops and host syncs a callable runs (in this thread).

Decode on a GPU is launch bound when each step runs thousands of small ops from Python, and a
host sync (a device value read by the host: `.item()`, `int(t)`, `nonzero`, `.tolist()`) stalls
the launch queue and makes the step impossible to capture in a CUDA graph. Both are counted on
any device, CPU included, with a `TorchDispatchMode`: every aten op the callable dispatches in
this thread is seen once at the Python dispatch level (ops a kernel runs internally are not).

Host syncs counted: `aten._local_scalar_dense` or, under inference mode, `aten.item` (`.item()`,
`int()`, `bool()`, `float()` of a tensor), `aten.nonzero` (its output size depends on the data),
`aten.equal`, and copies from another device to the CPU (`Tensor.cpu()`; `.tolist()` of a
device tensor goes through one).
`.tolist()` of a CPU tensor reads memory directly and dispatches nothing: on CPU it is invisible
here, so callables meant for a GPU should read results with `.cpu()` (counted) first.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# Ops whose result the host must wait for (see the module docstring).
SYNC_OPS = frozenset(
    {
        "aten._local_scalar_dense.default",
        "aten.item.default",
        "aten.nonzero.default",
        "aten.equal.default",
    }
)


@dataclass
class OpCount:
    """What one call dispatched: `ops` aten ops in all, `syncs` of them host syncs, `by_name`
    the count per op overload name (e.g. "aten.mm.default")."""

    ops: int = 0
    syncs: int = 0
    by_name: Counter[str] = field(default_factory=Counter)

    def sync_names(self) -> dict[str, int]:
        """The host-sync ops among `by_name`."""
        return {n: c for n, c in self.by_name.items() if _is_sync_name(n)}

    def top(self, n: int = 15) -> list[tuple[str, int]]:
        return self.by_name.most_common(n)


def _is_sync_name(name: str) -> bool:
    return name in SYNC_OPS or name.startswith("d2h:")


class _Counter(TorchDispatchMode):
    def __init__(self, count: OpCount) -> None:
        super().__init__()
        self.count = count

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        name = str(func)
        if _is_d2h_copy(func, args, kwargs):
            name = f"d2h:{name}"
        self.count.ops += 1
        self.count.by_name[name] += 1
        if _is_sync_name(name):
            self.count.syncs += 1
        return func(*args, **kwargs)


def _is_d2h_copy(func: Any, args: tuple, kwargs: dict) -> bool:
    """A copy that lands on the CPU from another device (`_to_copy`/`copy_`)."""
    if func is torch.ops.aten._to_copy.default:
        src, dst = args[0], kwargs.get("device")
        return (
            isinstance(src, torch.Tensor)
            and src.device.type != "cpu"
            and dst is not None
            and (torch.device(dst).type == "cpu")
        )
    if func is torch.ops.aten.copy_.default:
        dst, src = args[0], args[1]
        return dst.device.type == "cpu" and src.device.type != "cpu"
    return False


def count_ops(fn: Callable[[], Any]) -> OpCount:
    """Run `fn()` once under the counter and return what it dispatched (a closure keeps the
    result if the caller needs it)."""
    count = OpCount()
    with _Counter(count):
        fn()
    return count
