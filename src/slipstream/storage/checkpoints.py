"""Resumable checkpoints of the whole RL job in the same store as the weights.

Layout: <url>/ckpt/step_00000040/{trainer.pt, coordinator.json, manifest.json}, manifest LAST
(same rule as weights: a checkpoint exists iff its manifest does, and files are verified against
it on load).

- trainer.pt: `Trainer.state_dict()` (model, optimizer, scheduler, RNG, step, version, critic).
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
        done = self.steps()
        for s in done[: max(0, len(done) - self.keep)]:
            self.blob.rm(f"{self._dir(s)}/{MANIFEST}")
            self.blob.rm(self._dir(s))
        for s in self._all():
            if s < step and s not in done:
                self.blob.rm(self._dir(s))  # debris of a save that died half-way

    def load(self, step: int) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
        """(trainer_state, coordinator_state, manifest)."""
        manifest, files = read_manifested(self.blob, self._dir(step))
        trainer_state = torch.load(io.BytesIO(files["trainer.pt"]), weights_only=False)
        return trainer_state, json.loads(files["coordinator.json"]), manifest
