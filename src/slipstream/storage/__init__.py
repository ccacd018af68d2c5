"""Durable state of a job under one URL (`store.url`: a path, file://..., s3://bucket/prefix):
published policy versions and resumable trainer checkpoints, both written manifest-last.

    stores = open_stores(cfg)          # Stores(weights=WeightStore, checkpoints=CheckpointStore)
    stores.weights.publish(version, state_dict, hf_config)
    stores.checkpoints.save(step, trainer_state, coordinator_state)

`store.url` is resolved once when the config loads (empty -> `<run.output_dir>/store`, absolute),
so every process of a job (trainer ranks, rollout workers on other nodes) opens the same stores
from the same config. Layout and contracts: `blob.py` (the manifest rule), `weights.py`,
`checkpoints.py`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from slipstream.config import SlipstreamConfig
from slipstream.config.rl import StoreConfig
from slipstream.storage.blob import MANIFEST, BlobStore, read_manifested, write_manifested
from slipstream.storage.checkpoints import CheckpointStore
from slipstream.storage.weights import WeightStore, state_dict_to_bytes


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
    weights = WeightStore(cfg.store.url, cfg.store.keep_last, storage_options(cfg.store))
    return Stores(weights, CheckpointStore(weights.blob, cfg.store.keep_checkpoints))


__all__ = [
    "MANIFEST",
    "BlobStore",
    "CheckpointStore",
    "Stores",
    "WeightStore",
    "open_stores",
    "read_manifested",
    "state_dict_to_bytes",
    "storage_options",
    "write_manifested",
]
