"""Durable state of a job under one URL (`store.url`: a path, file://..., s3://bucket/prefix):
published policy versions and resumable trainer checkpoints, both written manifest-last, and
the lock that keeps it to one writer.

    stores = open_stores(cfg)          # Stores(weights=WeightStore, checkpoints=CheckpointStore)
    stores.weights.publish(version, state_dict, hf_config)
    stores.checkpoints.save(step, trainer_state, coordinator_state)
    point = stores.checkpoints.latest_valid()       # newest valid checkpoint + the bad ones skipped
    with job_locks(cfg, owner="slipstream run"): ...   # one job per output_dir and store

`store.url` is resolved once when the config loads (empty -> `<run.output_dir>/store`, absolute),
so every process of a job (trainer ranks, rollout workers on other nodes) opens the same stores
from the same config. Layout and contracts: `blob.py` (the manifest rule, what is validated),
`weights.py`, `checkpoints.py`, `state.py` (trainer state without pickle), `lock.py`; errors in
`errors.py` (importable without torch: this package loads its torch-using modules lazily, on
first use of a name, so `slipstream.storage.errors` is cheap for the CLI).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from slipstream.storage.errors import (
    InvalidEntry,
    LockLost,
    NonFiniteTensor,
    NoValidCheckpoint,
    StoreError,
    StoreLocked,
)

if TYPE_CHECKING:
    from slipstream.config import SlipstreamConfig
    from slipstream.config.rl import StoreConfig
    from slipstream.storage.blob import MANIFEST, BlobStore, read_manifested, write_manifested
    from slipstream.storage.checkpoints import BadCheckpoint, CheckpointStore, ResumePoint
    from slipstream.storage.lock import JobLocks, StoreLock, job_locks
    from slipstream.storage.weights import WeightStore, check_finite, state_dict_to_bytes

# name -> module that defines it (imported on first access: PEP 562)
_LAZY = {
    "MANIFEST": "blob",
    "BlobStore": "blob",
    "read_manifested": "blob",
    "write_manifested": "blob",
    "BadCheckpoint": "checkpoints",
    "CheckpointStore": "checkpoints",
    "ResumePoint": "checkpoints",
    "JobLocks": "lock",
    "StoreLock": "lock",
    "job_locks": "lock",
    "WeightStore": "weights",
    "check_finite": "weights",
    "state_dict_to_bytes": "weights",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(f"slipstream.storage.{_LAZY[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'slipstream.storage' has no attribute {name!r}")


@dataclass(frozen=True)
class Stores:
    """The two stores of one job; they share one BlobStore (one URL, one filesystem client)."""

    weights: WeightStore
    checkpoints: CheckpointStore


def storage_options(store: StoreConfig) -> dict[str, Any]:
    """fsspec options for [store] (an S3 endpoint other than AWS's: MinIO, moto, ...)."""
    if store.endpoint_url:
        return {"client_kwargs": {"endpoint_url": store.endpoint_url}}
    return {}


def open_stores(cfg: SlipstreamConfig) -> Stores:
    """The weight store and checkpoint store at cfg.store.url, with [store]'s retention."""
    from slipstream.storage.checkpoints import CheckpointStore
    from slipstream.storage.weights import WeightStore

    weights = WeightStore(cfg.store.url, cfg.store.keep_last, storage_options(cfg.store))
    return Stores(weights, CheckpointStore(weights.blob, cfg.store.keep_checkpoints))


__all__ = [
    "MANIFEST",
    "BadCheckpoint",
    "BlobStore",
    "CheckpointStore",
    "InvalidEntry",
    "JobLocks",
    "LockLost",
    "NoValidCheckpoint",
    "NonFiniteTensor",
    "ResumePoint",
    "StoreError",
    "StoreLock",
    "StoreLocked",
    "Stores",
    "WeightStore",
    "check_finite",
    "job_locks",
    "open_stores",
    "read_manifested",
    "state_dict_to_bytes",
    "storage_options",
    "write_manifested",
]
