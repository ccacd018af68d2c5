"""Leave a torch.distributed process without running the interpreter's finalization.

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
import sys
from typing import NoReturn

import torch.distributed as dist


def exit_distributed_process(code: int = 0) -> NoReturn:
    """Destroy the default process group if any, flush stdio and logging, then os._exit(code)."""
    if dist.is_initialized():
        dist.destroy_process_group()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
