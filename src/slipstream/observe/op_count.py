"""Count the aten ops a piece of torch code dispatches, and its host syncs.

`count_ops(fn)` runs `fn()` once under a `TorchDispatchMode` and counts every aten op that
reaches the dispatcher below autograd (forward ops, and the backward ops autograd runs from
`.backward()` called inside `fn`), by name. On a GPU each counted op is (at least) one kernel
launch and one trip through the Python/C++ dispatcher, so the count is the launch-overhead
budget of a step; a host sync stalls the CPU until the device catches up.

Host syncs counted: `aten::_local_scalar_dense` (what `.item()`, `float(t)`, `int(t)`,
`bool(t)` lower to; `aten::item` itself under inference mode, where it is not decomposed), copies
from another device to the CPU (counted as "aten::_to_copy(to host)" / "aten::copy_(to host)":
`Tensor.cpu()`, and `.tolist()` of a device tensor), `aten::nonzero` and its variants (`torch.where(cond)`), indexing with a
boolean mask (counted as "aten::index(bool mask)": its nonzero runs inside the kernel), `aten::equal` and `aten::is_nonzero` (Python truthiness of a tensor).
Each of these must read a device value on the host before the next op can be issued.
`Tensor.tolist()` and `Tensor.numpy()` read a tensor on the host too, but on a CPU tensor they
dispatch no aten op (on CUDA they copy to the host first): a `TorchFunctionMode` counts them
as "Tensor.tolist" / "Tensor.numpy" syncs (in `by_name`, not in `ops`).

In-thread only: the mode is thread-local, so autograd's backward (which runs on the calling
thread for CPU tensors, and on a device thread for CUDA tensors) is counted on CPU. Count on
CPU for a device-independent figure (the tests do); ops dispatched by other threads (a
background publisher, DataLoader workers) are not counted.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

MASK_INDEX = "aten::index(bool mask)"
TO_HOST = "(to host)"  # suffix of a copy from another device to the CPU
_MASK_INDEXING = frozenset(
    {"aten::index", "aten::index_put", "aten::index_put_", "aten::_index_put_impl_"}
)
SYNC_OPS = frozenset(
    {
        MASK_INDEX,
        "aten::_local_scalar_dense",
        "aten::item",
        f"aten::_to_copy{TO_HOST}",
        f"aten::copy_{TO_HOST}",
        "aten::nonzero",
        "aten::nonzero_static",  # static size: no sync on CUDA, but listed so a count shows it
        "aten::nonzero_numpy",
        "aten::equal",
        "aten::is_nonzero",
        "aten::masked_select",
        "aten::unique",
        "aten::_unique2",
        "aten::unique_consecutive",
        "aten::repeat_interleave",  # with a tensor of repeats and no output_size
    }
)
"""Ops whose output shape or value the host must read from the device. `nonzero_static` (its
size is given) does not sync on CUDA and is not counted as a sync; it stays in `by_name`."""
_NOT_SYNCS = frozenset({"aten::nonzero_static"})

# Ops that only describe a tensor (views of metadata, no kernel): listed separately so a count
# can say how many of its ops launch work.
_METADATA_OPS = frozenset(
    {
        "aten::view",
        "aten::_unsafe_view",
        "aten::reshape",
        "aten::t",
        "aten::transpose",
        "aten::permute",
        "aten::expand",
        "aten::unsqueeze",
        "aten::squeeze",
        "aten::slice",
        "aten::select",
        "aten::detach",
        "aten::alias",
        "aten::split",
        "aten::split_with_sizes",
        "aten::unbind",
        "aten::chunk",
        "aten::as_strided",
        "aten::_reshape_alias",
        "aten::lift_fresh",
    }
)


@dataclass(frozen=True)
class OpCount:
    ops: int
    """Aten ops dispatched (every call, views included)."""
    syncs: int
    """Host syncs among them (ops in SYNC_OPS other than nonzero_static)."""
    by_name: dict[str, int] = field(default_factory=dict)
    """Calls per op, "aten::name" (overload dropped), most frequent first."""

    @property
    def kernels(self) -> int:
        """Ops other than pure metadata views (an upper bound on the kernels launched)."""
        return self.ops - sum(n for k, n in self.by_name.items() if k in _METADATA_OPS)

    def sync_ops(self) -> dict[str, int]:
        """The host-sync ops and their calls."""
        return {k: n for k, n in self.by_name.items()
                if (k in SYNC_OPS and k not in _NOT_SYNCS) or k.startswith("Tensor.")}  # fmt: skip

    def top(self, n: int = 15) -> list[tuple[str, int]]:
        return list(self.by_name.items())[:n]


class _Counter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        name = func._schema.name
        if name in _MASK_INDEXING and _has_bool_index(args):
            # a bool mask index runs nonzero inside the kernel on CPU (no dispatch to see)
            name = MASK_INDEX
        elif _is_to_host_copy(func, args, kwargs or {}):
            name += TO_HOST
        self.calls[name] += 1
        return func(*args, **(kwargs or {}))


def _has_bool_index(args: tuple) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return isinstance(indices, list | tuple) and any(
        isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices
    )


def _is_to_host_copy(func: Any, args: tuple, kwargs: dict) -> bool:
    """A copy that lands on the CPU from another device (`_to_copy` / `copy_`)."""
    if func is torch.ops.aten._to_copy.default:
        src, dst = args[0], kwargs.get("device")
        return (isinstance(src, torch.Tensor) and src.device.type != "cpu" and dst is not None
                and torch.device(dst).type == "cpu")  # fmt: skip
    if func is torch.ops.aten.copy_.default:
        dst, src = args[0], args[1]
        return dst.device.type == "cpu" and src.device.type != "cpu"
    return False


_HOST_READS = {torch.Tensor.tolist: "Tensor.tolist", torch.Tensor.numpy: "Tensor.numpy"}


class _HostReads(TorchFunctionMode):
    """Counts the host reads that dispatch no aten op on CPU tensors."""

    def __init__(self, calls: Counter[str]) -> None:
        super().__init__()
        self.calls = calls

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        name = _HOST_READS.get(func)
        if name is not None:
            self.calls[name] += 1
        return func(*args, **(kwargs or {}))


def count_ops(fn: Callable[[], Any]) -> OpCount:
    """Run `fn()` once and count the aten ops it dispatches on this thread (module docstring)."""
    mode = _Counter()
    with _HostReads(mode.calls), mode:
        fn()
    by_name = dict(mode.calls.most_common())
    syncs = sum(n for k, n in by_name.items() if k in SYNC_OPS and k not in _NOT_SYNCS)
    host = sum(n for k, n in by_name.items() if k in _HOST_READS.values())
    return OpCount(ops=sum(by_name.values()) - host, syncs=syncs + host, by_name=by_name)


__all__ = ["SYNC_OPS", "OpCount", "count_ops"]
