"""What every slipstream process sets up the same way: device, torch threads, seeds, and how a
torch.distributed process leaves.

    device, dtype = setup_torch(cfg.run)     # threads, seeds (torch, python), device, dtype
    device = resolve_device(cfg.run)         # "auto" -> CUDA when torch sees one
    results = spawn_ranks("pkg.mod:fn", world, kwargs)   # fn(**kwargs) on `world` gloo ranks

Used by the SFT job, evaluation, the RL controller, trainer ranks and rollout workers alike, so
none of them borrows it from another job's module.

## Leaving a distributed process (`exit_distributed_process`)

Leave a torch.distributed process without running the interpreter's finalization.

Why: gloo's worker threads release the last collective's work object (and with it the tensors
it holds) slightly after `wait()` returns in Python. When the process exits right after its
last collective, that release can race `Py_FinalizeEx`: the thread asks for the GIL while the
interpreter is being torn down, CPython ends the thread with a forced unwind, and libstdc++
aborts ("terminate called without an active exception", SIGABRT). Seen here about once in 20
two-rank runs with torch 2.13 (core dump: `ProcessGroupGloo::runLoop` -> `~AsyncAllreduceWork`
-> `gil_scoped_acquire` during `Py_FinalizeEx`); the same race is the subject of pytorch PR
179291, which was not merged. destroy_process_group() and a barrier do not close the window.

So a process whose work is done (results saved, files closed) flushes what Python buffers
and leaves with os._exit. Not covered: the error path, which exits normally so its traceback
prints; a process that still has unsaved state must not call this; atexit handlers do not run
(e.g. coverage data of a spawned child is not written).
"""

from __future__ import annotations

import datetime
import importlib
import logging
import os
import random
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from slipstream.config.run import RunConfig


def resolve_device(run: RunConfig) -> torch.device:
    """[run].device as a torch device: "auto" is CUDA when torch sees one, else CPU; "cuda"
    without a CUDA device is an error."""
    if run.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if run.device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("run.device = 'cuda' but torch sees no CUDA device")
    return torch.device(run.device)


def set_threads(run: RunConfig) -> None:
    """torch intra-op threads per [run].num_threads (0 leaves torch's default)."""
    if run.num_threads:
        torch.set_num_threads(run.num_threads)


COMPUTE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
"""trainer.precision -> the trainer's compute dtype (autocast; FSDP2's parameter dtype)."""


def setup_torch(run: RunConfig) -> tuple[torch.device, torch.dtype]:
    """Threads, seeds (torch and python's `random`), device and dtype for a job, from [run]."""
    set_threads(run)
    torch.manual_seed(run.seed)
    random.seed(run.seed)
    return resolve_device(run), getattr(torch, run.dtype)


def exit_distributed_process(code: int = 0) -> NoReturn:
    """Destroy the default process group if any, flush stdio and logging, then os._exit(code)."""
    if dist.is_initialized():
        dist.destroy_process_group()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def resolve_target(target: str) -> Callable[..., Any]:
    """The function a "module:function" string names."""
    mod, _, fn = target.partition(":")
    if not fn:
        raise ValueError(f"target={target!r}: expected 'module:function'")
    return getattr(importlib.import_module(mod), fn)


def _rank_entry(rank: int, world: int, tmp: str, target: str, kwargs: dict[str, Any],
                threads: int, timeout_s: float) -> None:  # fmt: skip
    torch.set_num_threads(threads)
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=timeout_s),
    )  # fmt: skip
    try:
        result = resolve_target(target)(**kwargs)
        torch.save(result, f"{tmp}/result_{rank}.pt")
        dist.barrier()
    except BaseException:
        dist.destroy_process_group()
        raise
    exit_distributed_process(0)  # a normal exit can abort in gloo (see the module docstring)


def spawn_ranks(target: str, world: int, kwargs: dict[str, Any] | None = None, *,
                threads: int = 1, timeout_s: float = 120.0) -> list[Any]:  # fmt: skip
    """Run `target(**kwargs)` ("module:function") on `world` local processes joined by a fresh
    gloo process group (rendezvous through a file in a temporary directory: no ports to race
    for); -> its (picklable) return values in rank order. `timeout_s` bounds each collective, so
    a hang fails instead of blocking forever. A failing rank makes the others stop and this raise.
    Used by tests and benchmarks to run distributed code for real on one machine."""
    import torch.multiprocessing as mp

    resolve_target(target)  # fail here, not in every child
    # gloo resolves the hostname to pick an interface; loopback always works on one machine
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    with tempfile.TemporaryDirectory(prefix="slipstream-ranks-") as tmp:
        mp.spawn(_rank_entry, args=(world, tmp, target, kwargs or {}, threads, timeout_s),
                 nprocs=world, join=True)  # fmt: skip
        return [torch.load(Path(tmp) / f"result_{r}.pt", weights_only=False) for r in range(world)]
