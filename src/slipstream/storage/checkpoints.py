"""Resumable checkpoints of the whole RL job in the same store as the weights.

Layout: <url>/ckpt/step_00000040/{trainer.safetensors, trainer.json, coordinator.json,
manifest.json}, manifest LAST (same rule as weights: a checkpoint exists iff its manifest does,
and files are verified against it on load). A sharded trainer (slipstream.parallel) writes
instead {trainer/ (a torch.distributed.checkpoint directory: every rank's shards + .metadata),
trainer_meta.json, coordinator.json, manifest.json}; the manifest lists the DCP files with
their sizes (checked before loading; their bytes are DCP's to check) and the JSON files with
sizes and hashes.

- trainer.safetensors + trainer.json: `Trainer.state_dict()` (model, optimizer, scheduler, RNG,
  step; critic / reference model) without pickle (storage/state.py: tensors as safetensors, the
  rest as tagged JSON), restored bit for bit. Checkpoints of the older format (`trainer.pt`, a
  pickle) are refused, never unpickled: loading a pickle runs whatever code its writer chose.
- coordinator.json: queue + buffer + version snapshot taken at the same step boundary, so a
  resumed run neither loses a task (tasks leased at save time come back as pending) nor repeats
  one (tasks trained before the save are `done`; groups acked after it are regenerated, because
  the trainer that consumed them is rolled back too).

Validity and fallback: `check(step)` reads and decodes a checkpoint and returns why it cannot be
resumed (None when it can): manifest not JSON, a file missing, truncated or of the wrong hash, a
step that does not match its directory, an undecodable state, a pickle. `latest_valid()` is the
resume point: the newest valid checkpoint, with the newer bad ones skipped (each logged as a
warning and returned with its reason); `NoValidCheckpoint` when checkpoints exist but none is
valid (starting over silently would throw away a run). I/O errors (network, permissions) are
raised, never taken for corruption. `remove_after(step)` deletes the skipped newer ones once the
resume succeeded, so retention never keeps a bad checkpoint in place of a good one.

`save` refuses a trainer state holding a NaN/inf tensor (`NonFiniteTensor`, naming it): a
diverged run fails at its checkpoint instead of overwriting the last good one.

Not covered: checkpoints that must survive a change of the model architecture or world size;
the content of coordinator.json beyond being a JSON object (its restore checks it); the DCP
`.metadata` of sharded checkpoints, which DCP unpickles (a store writer can run code in a
sharded trainer; see docs/security.md).
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from typing import Any

import torch

from slipstream.storage.blob import MANIFEST, BlobStore, read_manifested, write_manifested
from slipstream.storage.errors import InvalidEntry, NoValidCheckpoint
from slipstream.storage.state import decode_state, encode_state
from slipstream.storage.weights import check_finite

log = logging.getLogger(__name__)

_STEP_RE = re.compile(r"step_(\d{8})$")
SHARDED_DIR = "trainer"  # a sharded trainer's DCP checkpoint, inside ckpt/step_N/
TENSORS_FILE = "trainer.safetensors"
STATE_FILE = "trainer.json"
LEGACY_PICKLE = "trainer.pt"


@dataclass(frozen=True)
class BadCheckpoint:
    """A checkpoint that cannot be resumed, and why."""

    step: int
    reason: str


@dataclass(frozen=True)
class ResumePoint:
    """Where to resume: the newest valid checkpoint (None: there is none, start fresh) and the
    newer checkpoints skipped because they are invalid, newest first."""

    step: int | None
    skipped: tuple[BadCheckpoint, ...] = ()

    def warnings(self) -> list[str]:
        """One line per skipped checkpoint (for the log and the run's report)."""
        to = f"step {self.step}" if self.step is not None else "nothing"
        return [f"checkpoint step {b.step} is invalid ({b.reason}); resuming from {to}"
                for b in self.skipped]  # fmt: skip


def _json_object(where: str, raw: bytes) -> dict[str, Any]:
    try:
        value = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise InvalidEntry(f"{where}: not JSON ({type(e).__name__}: {e})") from None
    if not isinstance(value, dict):
        raise InvalidEntry(f"{where}: not a JSON object")
    return value


def _tensors(tree: Any, path: str = "") -> dict[str, torch.Tensor]:
    """Every tensor of a state tree by its path (model/..., optimizer/state/3/exp_avg)."""
    out: dict[str, torch.Tensor] = {}
    if isinstance(tree, torch.Tensor):
        out[path or "/"] = tree
    elif isinstance(tree, dict):
        for k, v in tree.items():
            out.update(_tensors(v, f"{path}/{k}" if path else str(k)))
    elif isinstance(tree, list | tuple):
        for i, v in enumerate(tree):
            out.update(_tensors(v, f"{path}[{i}]"))
    return out


class CheckpointStore:
    def __init__(self, blob: BlobStore, keep: int = 2) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.blob = blob
        self.keep = keep

    @staticmethod
    def _dir(step: int) -> str:
        return f"ckpt/step_{step:08d}"

    def _where(self, step: int, name: str = "") -> str:
        return self.blob.url_of(f"{self._dir(step)}/{name}" if name else self._dir(step))

    def _all(self) -> list[int]:
        return [int(m.group(1)) for n in self.blob.listdir("ckpt") if (m := _STEP_RE.match(n))]

    def steps(self) -> list[int]:
        """Complete (manifested) checkpoints, ascending; not validated (see `check`)."""
        return [s for s in self._all() if self.blob.exists(f"{self._dir(s)}/{MANIFEST}")]

    def latest(self) -> int | None:
        """The newest manifested checkpoint, valid or not; resume with `latest_valid()`."""
        s = self.steps()
        return s[-1] if s else None

    def save(
        self, step: int, trainer_state: dict[str, Any], coordinator_state: dict[str, Any],
        meta: dict[str, Any] | None = None,
    ) -> None:  # fmt: skip
        """Write checkpoint `step` (manifest last), replacing whatever is at its directory;
        NonFiniteTensor (nothing written) when a tensor of the state holds NaN/inf."""
        check_finite(
            _tensors(trainer_state), f"refusing to write checkpoint step {step} to {self.blob.url}"
        )
        tensors, tree = encode_state(trainer_state)
        files = {
            TENSORS_FILE: tensors,
            STATE_FILE: tree,
            "coordinator.json": json.dumps(coordinator_state).encode(),
        }
        self.blob.rm(self._dir(step))  # a bad or half-written checkpoint of this step
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

    def remove_after(self, step: int | None) -> list[int]:
        """Delete every checkpoint newer than `step` (None: all), manifest first; call it after
        resuming from `latest_valid().step` so the skipped bad ones are gone. Returns them."""
        gone = [s for s in self._all() if step is None or s > step]
        for s in gone:
            self.blob.rm(f"{self._dir(s)}/{MANIFEST}")
            self.blob.rm(self._dir(s))
        return gone

    def _manifested(self, step: int) -> tuple[dict[str, Any], dict[str, bytes]]:
        manifest, files = read_manifested(self.blob, self._dir(step))
        if manifest.get("step") != step:
            raise InvalidEntry(f"{self._where(step, MANIFEST)}: says step "
                               f"{manifest.get('step')!r}, its directory step {step}")  # fmt: skip
        return manifest, files

    def is_sharded(self, step: int) -> bool:
        manifest, _ = self._manifested(step)
        return "sharded" in manifest

    def load(self, step: int) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
        """(trainer_state, coordinator_state, manifest) of an unsharded checkpoint; InvalidEntry
        naming the file when it fails validation (nothing is unpickled)."""
        manifest, files = self._manifested(step)
        if "sharded" in manifest:
            raise ValueError(
                f"{self.blob.url}/{self._dir(step)} was written by a sharded trainer "
                "(trainer.parallel dp_shard x ep > 1); resume it with a sharded layout"
            )
        if LEGACY_PICKLE in files or LEGACY_PICKLE in manifest["files"]:
            raise InvalidEntry(f"{self._where(step, LEGACY_PICKLE)}: a pickled trainer state "
                               "(the format before safetensors + JSON); not loaded, because "
                               "unpickling runs code chosen by whoever wrote the store")  # fmt: skip
        for name in (TENSORS_FILE, STATE_FILE, "coordinator.json"):
            if name not in files:
                raise InvalidEntry(f"{self._where(step)}: the manifest does not list {name}")
        trainer_state = decode_state(files[TENSORS_FILE], files[STATE_FILE],
                                     self._where(step, STATE_FILE))  # fmt: skip
        if not isinstance(trainer_state, dict) or trainer_state.get("step") != step:
            got = trainer_state.get("step") if isinstance(trainer_state, dict) else trainer_state
            raise InvalidEntry(f"{self._where(step, STATE_FILE)}: holds step {got!r:.40}, "
                               f"not {step}")  # fmt: skip
        coord = _json_object(self._where(step, "coordinator.json"), files["coordinator.json"])
        return trainer_state, coord, manifest

    def load_sharded(self, step: int) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
        """(trainer_meta, coordinator_state, manifest) of a sharded checkpoint, after checking
        that every DCP file is there with its recorded size; the shards themselves are read by
        DCP from `sharded_url(step)`."""
        manifest, files = self._manifested(step)
        if "sharded" not in manifest:
            raise ValueError(
                f"{self.blob.url}/{self._dir(step)} was written by an unsharded trainer; resume "
                "it with trainer.parallel dp_shard = ep = 1"
            )
        shards = manifest["sharded"]
        if not isinstance(shards, dict) or not all(
            isinstance(n, str) and type(s) is int for n, s in shards.items()
        ):
            raise InvalidEntry(f"{self._where(step, MANIFEST)}: 'sharded' is not a map of "
                               "file sizes")  # fmt: skip
        have = self.blob.sizes(f"{self._dir(step)}/{SHARDED_DIR}")
        for name, size in shards.items():
            if have.get(name) != size:
                raise InvalidEntry(f"{self.sharded_url(step)}/{name}: {have.get(name)} bytes, "
                                   f"the manifest says {size}")  # fmt: skip
        for name in ("trainer_meta.json", "coordinator.json"):
            if name not in files:
                raise InvalidEntry(f"{self._where(step)}: the manifest does not list {name}")
        return (_json_object(self._where(step, "trainer_meta.json"), files["trainer_meta.json"]),
                _json_object(self._where(step, "coordinator.json"), files["coordinator.json"]),
                manifest)  # fmt: skip

    def check(self, step: int) -> str | None:
        """Why checkpoint `step` cannot be resumed (None: it can). Reads and decodes all of it
        (an unsharded one), or its JSON files and DCP file sizes (a sharded one). FileNotFoundError
        when it has no manifest; other I/O errors propagate."""
        try:
            if self.is_sharded(step):
                self.load_sharded(step)
            else:
                self.load(step)
        except InvalidEntry as e:
            return str(e)
        return None

    def status(self) -> list[dict[str, Any]]:
        """Every manifested checkpoint, ascending: {"step", "valid", "reason"} (`ckpt list`)."""
        out = []
        for s in self.steps():
            try:
                reason = self.check(s)
            except FileNotFoundError:
                continue  # removed by retention meanwhile
            out.append({"step": s, "valid": reason is None, "reason": reason})
        return out

    def latest_valid(self) -> ResumePoint:
        """The newest checkpoint that passes `check`, and the newer ones skipped (each logged as
        a warning). ResumePoint(None) when there are none; NoValidCheckpoint when there are
        some but none is valid."""
        skipped: list[BadCheckpoint] = []
        for s in reversed(self.steps()):
            try:
                reason = self.check(s)
            except FileNotFoundError:
                continue
            if reason is None:
                point = ResumePoint(s, tuple(skipped))
                for line in point.warnings():
                    log.warning("%s", line)
                return point
            skipped.append(BadCheckpoint(s, reason))
        if skipped:
            raise NoValidCheckpoint(
                f"no valid checkpoint in {self.blob.url_of('ckpt')}: "
                + "; ".join(f"step {b.step}: {b.reason}" for b in skipped)
                + ". Remove them (or use another store.url) to start the run over"
            )
        return ResumePoint(None)
