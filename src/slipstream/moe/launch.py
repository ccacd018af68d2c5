"""Run a function on `num_nodes x ranks_per_node` local processes as one EP group.

Used by the tests and `slipstream bench moe-dispatch` to run the dispatchers for real on one
machine: `runtime.spawn_ranks` (gloo over loopback; nodes are simulated, see rank_layout.py), then
every rank builds the EP layout and calls target(ep_group, **kwargs); the (picklable) return
values come back in rank order. A failing rank makes the others stop and this raise.
"""

from __future__ import annotations

from typing import Any

from slipstream.moe.rank_layout import EPGroup
from slipstream.runtime import resolve_target, spawn_ranks


def _ep_entry(target: str, layout: tuple[int, int, int], kwargs: dict[str, Any]) -> Any:
    group = EPGroup.create(*layout)
    return resolve_target(target)(group, **kwargs)


def spawn_ep(
    target: str,
    num_nodes: int,
    ranks_per_node: int,
    num_experts: int,
    kwargs: dict[str, Any] | None = None,
    threads: int = 1,
    timeout_s: float = 120.0,
) -> list[Any]:
    """Run target ("module:function") on every rank of a fresh gloo group as one EP group;
    -> its return values in rank order. `timeout_s` bounds each collective."""
    resolve_target(target)  # fail here, not in every child
    args = {"target": target, "layout": (num_nodes, ranks_per_node, num_experts),
            "kwargs": kwargs or {}}  # fmt: skip
    return spawn_ranks("slipstream.moe.launch:_ep_entry", num_nodes * ranks_per_node, args,
                       threads=threads, timeout_s=timeout_s)  # fmt: skip
