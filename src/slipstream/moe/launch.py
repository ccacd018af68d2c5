"""Run a function on `num_nodes x ranks_per_node` local processes joined by torch.distributed.

Used by the tests and `slipstream bench moe-dispatch` to run the dispatchers for real on one
machine: torch.multiprocessing.spawn, the gloo backend over loopback (nodes are simulated, see
topology.py), rendezvous through a file in a temporary directory (no ports to race for). The
target is named as "module:function" and is called as target(ep_group, **kwargs) in every rank;
its (picklable) return values come back in rank order. A failing rank makes spawn terminate the
others and raise.
"""

from __future__ import annotations

import datetime
import importlib
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from slipstream.moe.topology import EPGroup
from slipstream.runtime import exit_distributed_process


def _resolve(target: str) -> Callable[..., Any]:
    mod, _, fn = target.partition(":")
    if not fn:
        raise ValueError(f"target={target!r}: expected 'module:function'")
    return getattr(importlib.import_module(mod), fn)


def _entry(
    rank: int,
    layout: tuple[int, int, int],
    tmp: str,
    target: str,
    kwargs: dict[str, Any],
    threads: int,
    timeout_s: float,
) -> None:
    torch.set_num_threads(threads)
    num_nodes, ranks_per_node, num_experts = layout
    dist.init_process_group(
        "gloo",
        init_method=f"file://{tmp}/rendezvous",
        rank=rank,
        world_size=num_nodes * ranks_per_node,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    try:
        group = EPGroup.create(num_nodes, ranks_per_node, num_experts)
        result = _resolve(target)(group, **kwargs)
        torch.save(result, f"{tmp}/result_{rank}.pt")
        dist.barrier()
    except BaseException:
        dist.destroy_process_group()
        raise
    exit_distributed_process(0)  # see runtime.py: a normal exit can abort in gloo


def spawn_ep(
    target: str,
    num_nodes: int,
    ranks_per_node: int,
    num_experts: int,
    kwargs: dict[str, Any] | None = None,
    threads: int = 1,
    timeout_s: float = 120.0,
) -> list[Any]:
    """Run target on every rank of a fresh gloo group; -> its return values in rank order.
    `timeout_s` bounds each collective (a hang fails instead of blocking forever)."""
    _resolve(target)  # fail here, not in every child
    world = num_nodes * ranks_per_node
    # gloo resolves the hostname to pick an interface; loopback always works on one machine
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    with tempfile.TemporaryDirectory(prefix="slipstream-ep-") as tmp:
        mp.spawn(
            _entry,
            args=(
                (num_nodes, ranks_per_node, num_experts),
                tmp,
                target,
                kwargs or {},
                threads,
                timeout_s,
            ),
            nprocs=world,
            join=True,
        )
        return [torch.load(Path(tmp) / f"result_{r}.pt", weights_only=False) for r in range(world)]
