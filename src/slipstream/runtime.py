"""What every slipstream process sets up the same way: device, torch threads, seeds, and how a
torch.distributed process leaves.

    device, dtype = setup_torch(cfg.run)     # threads, seeds (torch, python), device, dtype
    device = resolve_device(cfg.run)         # "auto" -> CUDA when torch sees one

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

import logging
import os
import random
import sys
from typing import NoReturn

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
