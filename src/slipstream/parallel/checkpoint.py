"""Checkpoints of a sharded trainer with torch.distributed.checkpoint (DCP), in the job's store.

    save_sharded(ckpts, step, model, optimizer, trainer_meta, coordinator_state, meta, rank)
    coordinator_state, manifest, trainer_meta = load_sharded(ckpts, step, model, optimizer)

Every rank writes its own shards of the model and the optimizer state into
`<store>/ckpt/step_N/trainer/` (DCP, through fsspec for s3://); rank 0 then writes the JSON
parts (scheduler, RNG, step; the coordinator's queue and buffer) and the manifest last
(storage/checkpoints.py), so a checkpoint is complete iff its manifest exists. Loading goes
through DCP's resharding: a checkpoint written with one layout (e.g. ep 4) loads onto another
(ep 2, dp_shard 2), because every weight is saved as one global tensor with its placements.

Not covered: DCP's own .metadata is a pickle (a store writer can run code in the trainer, as
with any pickled checkpoint); asynchronous saves; optimizers other than AdamW.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from slipstream.storage import CheckpointStore


def _io(ckpts: CheckpointStore, step: int, write: bool) -> Any:
    url = ckpts.sharded_url(step)
    if ckpts.blob.local:
        return dcp.FileSystemWriter(url) if write else dcp.FileSystemReader(url)
    # fsspec-backed DCP storage (s3:// and other remote stores); a private module of torch,
    # the only DCP storage for remote filesystems it ships
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    opts = ckpts.blob.storage_options
    return FsspecWriter(url, **opts) if write else FsspecReader(url, **opts)


def save_sharded(ckpts: CheckpointStore, step: int, model: torch.nn.Module, optimizer: Any,
                 trainer_meta: dict[str, Any], coordinator_state: dict[str, Any] | None,
                 meta: dict[str, Any], *, rank: int) -> None:  # fmt: skip
    """Collective. Rank 0 passes the coordinator's state (others None) and completes it."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, storage_writer=_io(ckpts, step, True))
    dist.barrier()  # every rank's shards are written before the manifest says so
    if rank == 0:
        assert coordinator_state is not None
        ckpts.save_sharded(step, trainer_meta, coordinator_state, meta)
    dist.barrier()


def load_sharded(ckpts: CheckpointStore, step: int, model: torch.nn.Module, optimizer: Any
                 ) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:  # fmt: skip
    """Collective: load checkpoint `step` into the (sharded) model and optimizer, resharding to
    this layout; -> (coordinator state, manifest, trainer meta)."""
    trainer_meta, coordinator_state, manifest = ckpts.load_sharded(step)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, storage_reader=_io(ckpts, step, False))
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])  # fmt: skip
    return coordinator_state, manifest, trainer_meta
