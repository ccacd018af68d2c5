"""Resumable checkpoints of the whole RL job in the same store as the weights.

Layout: <url>/ckpt/step_00000040/{trainer.pt, coordinator.json, manifest.json}, manifest LAST
(same rule as weights: a checkpoint exists iff its manifest does, and files are verified against
it on load). A sharded trainer (slipstream.parallel) writes instead
{trainer/ (a torch.distributed.checkpoint directory: every rank's shards + .metadata),
trainer_meta.json, coordinator.json, manifest.json}; the manifest lists the DCP files with
their sizes (checked before loading; their bytes are DCP's to check) and the JSON files with
sizes and hashes.

- trainer.pt: `Trainer.state_dict()` (model, optimizer, scheduler, RNG, step, critic).
- coordinator.json: queue + buffer + version snapshot taken at the same step boundary, so a
  resumed run neither loses a task (tasks leased at save time come back as pending) nor repeats
  one (tasks trained before the save are `done`; groups acked after it are regenerated, because
  the trainer that consumed them is rolled back too).

Not covered: checkpoints that must survive a change of the model architecture or world size.
"""

from __future__ import annotations

import io
import json
import re
from typing import Any

import torch

from slipstream.storage.blob import MANIFEST, BlobStore, read_manifested, write_manifested

_STEP_RE = re.compile(r"step_(\d{8})$")
SHARDED_DIR = "trainer"  # a sharded trainer's DCP checkpoint, inside ckpt/step_N/


class CheckpointStore:
    def __init__(self, blob: BlobStore, keep: int = 2) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.blob = blob
        self.keep = keep

    @staticmethod
    def _dir(step: int) -> str:
        return f"ckpt/step_{step:08d}"

    def _all(self) -> list[int]:
        return [int(m.group(1)) for n in self.blob.listdir("ckpt") if (m := _STEP_RE.match(n))]

    def steps(self) -> list[int]:
        """Complete (manifested) checkpoints, ascending."""
        return [s for s in self._all() if self.blob.exists(f"{self._dir(s)}/{MANIFEST}")]

    def latest(self) -> int | None:
        s = self.steps()
        return s[-1] if s else None

    def save(
        self, step: int, trainer_state: dict[str, Any], coordinator_state: dict[str, Any],
        meta: dict[str, Any] | None = None,
    ) -> None:  # fmt: skip
        buf = io.BytesIO()
        torch.save(trainer_state, buf)
        files = {
            "trainer.pt": buf.getvalue(),
            "coordinator.json": json.dumps(coordinator_state).encode(),
        }
        write_manifested(self.blob, self._dir(step), files, {"step": step, **(meta or {})})
        self._retain(step)

    def sharded_url(self, step: int) -> str:
        """Where a sharded trainer writes its DCP checkpoint of `step` (path or URL)."""
        return self.blob.url_of(f"{self._dir(step)}/{SHARDED_DIR}")

    def save_sharded(self, step: int, trainer_meta: dict[str, Any],
                     coordinator_state: dict[str, Any], meta: dict[str, Any] | None = None) -> None:  # fmt: skip
        """Complete a sharded checkpoint once every rank's DCP save returned (rank 0 only)."""
        shards = self.blob.sizes(f"{self._dir(step)}/{SHARDED_DIR}")
        if not any(n.endswith(".metadata") for n in shards):
            raise OSError(f"{self.sharded_url(step)}: no DCP .metadata; the sharded save failed")
        files = {"trainer_meta.json": json.dumps(trainer_meta).encode(),
                 "coordinator.json": json.dumps(coordinator_state).encode()}  # fmt: skip
        write_manifested(self.blob, self._dir(step), files,
                         {"step": step, "sharded": shards, **(meta or {})})  # fmt: skip
        self._retain(step)

    def _retain(self, step: int) -> None:
        done = self.steps()
        for s in done[: max(0, len(done) - self.keep)]:
            self.blob.rm(f"{self._dir(s)}/{MANIFEST}")
            self.blob.rm(self._dir(s))
        for s in self._all():
            if s < step and s not in done:
                self.blob.rm(self._dir(s))  # debris of a save that died half-way

    def is_sharded(self, step: int) -> bool:
        manifest, _ = read_manifested(self.blob, self._dir(step))
        return "sharded" in manifest

    def load(self, step: int) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
        """(trainer_state, coordinator_state, manifest) of an unsharded checkpoint."""
        manifest, files = read_manifested(self.blob, self._dir(step))
        if "sharded" in manifest:
            raise ValueError(
                f"{self.blob.url}/{self._dir(step)} was written by a sharded trainer "
                "(trainer.parallel dp_shard x ep > 1); resume it with a sharded layout"
            )
        trainer_state = torch.load(io.BytesIO(files["trainer.pt"]), weights_only=False)
        return trainer_state, json.loads(files["coordinator.json"]), manifest

    def load_sharded(self, step: int) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
        """(trainer_meta, coordinator_state, manifest) of a sharded checkpoint, after checking
        that every DCP file is there with its recorded size; the shards themselves are read by
        DCP from `sharded_url(step)`."""
        manifest, files = read_manifested(self.blob, self._dir(step))
        if "sharded" not in manifest:
            raise ValueError(
                f"{self.blob.url}/{self._dir(step)} was written by an unsharded trainer; resume "
                "it with trainer.parallel dp_shard = ep = 1"
            )
        have = self.blob.sizes(f"{self._dir(step)}/{SHARDED_DIR}")
        for name, size in manifest["sharded"].items():
            if have.get(name) != size:
                raise OSError(f"{self.sharded_url(step)}/{name}: {have.get(name)} bytes, "
                              f"the manifest says {size}")  # fmt: skip
        return (json.loads(files["trainer_meta.json"]), json.loads(files["coordinator.json"]),
                manifest)  # fmt: skip
