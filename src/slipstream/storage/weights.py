"""WeightStore: published policy versions under a URL (file://, s3:// or a plain path) via fsspec.

Layout: <url>/weights/v00000012/{model.safetensors, config.json, manifest.json}. The directory is
an HF-format checkpoint (safetensors + config.json) that `load_pretrained` can read once copied
locally (`fetch_to_dir`).

Contract:
- `publish(version, state_dict, config)` writes the weight files first and `manifest.json` LAST.
  The manifest is written in one atomic step (a rename on local disks, a single PUT on S3) and
  lists every file with its size and sha256. A version exists for readers iff its manifest does.
- Readers (`versions`, `latest`, `fetch`) look only at manifests and verify sizes and hashes, so
  a publish that died half-way (process or server killed) is never visible; publishing the same
  version again overwrites the debris.
- After a publish, versions beyond the newest `keep_last` are deleted (manifest first, so readers
  stop seeing them before their files go), and manifest-less debris of older versions is removed.
- `publish` refuses a state dict with a NaN/inf value (`NonFiniteTensor`, naming the tensor and
  how many values): a diverged trainer (a NaN loss, an infinite learning rate) fails loudly
  instead of serving garbage. `check_finite` is the same test for any other caller.
- `check(version)` says why a published version cannot be loaded (manifest, sizes, hashes, the
  safetensors and config.json parse, finite values), or None; `ckpt list` shows it.

Not covered: several concurrent publishers to one URL (one trainer publishes; `slipstream run`
holds the store's lock, storage/lock.py, so a second job is refused), a reader that fetches a
version while retention deletes it (it gets FileNotFoundError and should ask `latest()` again;
keep_last >= 2 makes that rare).
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Mapping
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from slipstream.storage.blob import (
    MANIFEST,
    BlobStore,
    read_manifested,
    with_path,
    write_manifested,
)
from slipstream.storage.errors import InvalidEntry, NonFiniteTensor
from slipstream.storage.safetensors_buffer import SafetensorsBuffer

log = logging.getLogger(__name__)

_VERSION_RE = re.compile(r"v(\d{8})$")
WEIGHTS_FILE = "model.safetensors"


def state_dict_to_bytes(state_dict: dict[str, torch.Tensor]) -> bytes:
    """safetensors bytes; tensors that share storage (tied weights) are cloned apart."""
    seen: set[int] = set()
    out: dict[str, torch.Tensor] = {}
    for k, v in state_dict.items():
        t = v.detach().cpu().contiguous()
        if t.untyped_storage().data_ptr() in seen:
            t = t.clone()
        seen.add(t.untyped_storage().data_ptr())
        out[k] = t
    return st_save(out)


def check_finite(tensors: Mapping[str, torch.Tensor], what: str) -> None:
    """NonFiniteTensor naming the first floating-point tensor of `tensors` with a NaN or inf
    value (and how many tensors have one); integer and bool tensors cannot hold either. One
    host sync per device, not per tensor.

    Fast path (every publish runs this): one fused 2-norm over a device's real floating-point
    tensors (`get_total_norm`, foreach): a NaN or inf anywhere makes it non-finite, so a finite
    norm proves every value finite (0.5 ms vs 5-7 ms for the per-tensor scan of the
    quickstart's 135 tensors on this dev VM). A non-finite norm can also come from finite
    values above ~1.8e19 whose squares overflow, so it falls back to the exact per-tensor scan,
    which decides and names the tensor."""
    by_device: dict[torch.device, list[tuple[str, torch.Tensor]]] = {}
    for name, t in tensors.items():
        if t.is_floating_point() or t.is_complex():
            by_device.setdefault(t.device, []).append((name, t.detach()))
    bad: list[tuple[str, int, int]] = []
    for device, items in by_device.items():
        if _norm_proves_finite(device, [t for _, t in items]):
            continue
        counts = torch.stack([(~torch.isfinite(t)).sum() for _, t in items]).tolist()
        bad += [(name, int(n), t.numel()) for (name, t), n in zip(items, counts, strict=True) if n]
    if bad:
        name, n, total = bad[0]
        more = f" (and {len(bad) - 1} more tensors)" if len(bad) > 1 else ""
        raise NonFiniteTensor(
            f"{what}: tensor {name!r} has {n} of {total} values NaN or inf{more} "
            "(a diverged training run? see the loss and trainer.lr)"
        )


def _norm_proves_finite(device: torch.device, tensors: list[torch.Tensor]) -> bool:
    if device.type not in ("cpu", "cuda") or any(t.is_complex() for t in tensors):
        return False
    norm = torch.nn.utils.get_total_norm(tensors, 2.0, foreach=True)
    return bool(torch.isfinite(norm))


class WeightStore:
    """Policy versions for rollout engines. See the module docstring for the contract."""

    def __init__(
        self, url: str, keep_last: int = 3, storage_options: dict[str, Any] | None = None
    ) -> None:
        if keep_last < 1:
            raise ValueError(f"keep_last must be >= 1, got {keep_last}")
        self.blob = BlobStore(url, storage_options)
        self.keep_last = keep_last

    @staticmethod
    def _dir(version: int) -> str:
        return f"weights/v{version:08d}"

    def publish(
        self,
        version: int,
        state_dict: Mapping[str, torch.Tensor] | SafetensorsBuffer,
        config: dict[str, Any] | None = None,
    ) -> None:
        """Write version `version` (see the module contract). `state_dict` may be a filled
        `SafetensorsBuffer` (what a trainer publishing every step hands over): its file is
        written as it is, with no serialisation on this thread."""
        what = f"refusing to publish weights version {version} to {self.blob.url}"
        data: bytes | memoryview
        if isinstance(state_dict, SafetensorsBuffer):
            check_finite(state_dict.tensors(), what)
            data = state_dict.file_bytes()
        else:
            check_finite(state_dict, what)
            data = state_dict_to_bytes(dict(state_dict))
        files: dict[str, bytes | memoryview] = {WEIGHTS_FILE: data}
        if config is not None:
            files["config.json"] = json.dumps(config, indent=1).encode()
        write_manifested(self.blob, self._dir(version), files, {"version": version})
        self._retain(version)

    def _all_dirs(self) -> list[tuple[int, str]]:
        out = []
        for name in self.blob.listdir("weights"):
            m = _VERSION_RE.match(name)
            if m:
                out.append((int(m.group(1)), name))
        return out

    def versions(self) -> list[int]:
        """Published (manifested) versions, ascending."""
        return [v for v, name in self._all_dirs() if self.blob.exists(f"weights/{name}/{MANIFEST}")]

    def latest(self) -> int | None:
        vs = self.versions()
        return vs[-1] if vs else None

    def _files(self, version: int) -> dict[str, bytes]:
        _, files = read_manifested(self.blob, self._dir(version))
        if WEIGHTS_FILE not in files:
            raise InvalidEntry(f"{self.location(version)}: the manifest lists no {WEIGHTS_FILE}")
        return files

    def _tensors(self, version: int, files: dict[str, bytes]) -> dict[str, torch.Tensor]:
        try:
            return st_load(files[WEIGHTS_FILE])
        except (SafetensorError, ValueError, RuntimeError) as e:
            raise InvalidEntry(f"{self.location(version)}/{WEIGHTS_FILE}: not a valid "
                               f"safetensors file ({e})") from None  # fmt: skip

    def fetch(self, version: int) -> dict[str, torch.Tensor]:
        """The state dict of a published version (FileNotFoundError if not published,
        InvalidEntry when it fails validation)."""
        files = self._files(version)
        return self._tensors(version, files)

    def fetch_config(self, version: int) -> dict[str, Any] | None:
        files = self._files(version)
        if "config.json" not in files:
            return None
        try:
            return json.loads(files["config.json"])
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
            raise InvalidEntry(f"{self.location(version)}/config.json: not JSON ({e})") from None

    def check(self, version: int) -> str | None:
        """Why a published version cannot be loaded (None: it can): manifest, sizes, hashes,
        safetensors and config.json parse, finite values. FileNotFoundError if unpublished."""
        try:
            files = self._files(version)
            check_finite(self._tensors(version, files), f"{self.location(version)}")
            self.fetch_config(version)
        except (InvalidEntry, NonFiniteTensor) as e:
            return str(e)
        return None

    def status(self) -> list[dict[str, Any]]:
        """Every published version, ascending: {"version", "valid", "reason"} (`ckpt list`)."""
        out = []
        for v in self.versions():
            try:
                reason = self.check(v)
            except FileNotFoundError:
                continue  # removed by retention meanwhile
            out.append({"version": v, "valid": reason is None, "reason": reason})
        return out

    def location(self, version: int) -> str:
        """Where a version's HF-format directory lives: a local path, or a URL (s3://...) for
        other stores. For engine servers that load weights themselves
        (`/update_weights_from_disk`); they must reach it (the same filesystem, or credentials of
        their own) and, unlike `fetch`, do not check the manifest's hashes."""
        return self.blob.url_of(self._dir(version))

    def fetch_to_dir(self, version: int, local_dir: str) -> str:
        """Copy a published version into a local HF-format directory; returns it."""
        files = self._files(version)  # names checked: plain relative names, no '..'
        os.makedirs(local_dir, exist_ok=True)
        for name, data in files.items():
            path = os.path.join(local_dir, name)
            try:
                with open(path, "wb") as f:
                    f.write(data)
            except OSError as e:  # ENOSPC on write names no file: say which
                raise with_path(e, path) from e
        return local_dir

    def remove_after(self, version: int) -> list[int]:
        """Unpublish every version newer than `version` (a resumed trainer rolls back to its
        checkpoint; weights it published after that must not reach workers). Returns them."""
        gone = [v for v, _ in self._all_dirs() if v > version]
        for v in gone:
            self.blob.rm(f"{self._dir(v)}/{MANIFEST}")
            self.blob.rm(self._dir(v))
        return gone

    def _retain(self, just_published: int) -> None:
        published = self.versions()
        for v in published[: max(0, len(published) - self.keep_last)]:
            self.blob.rm(f"{self._dir(v)}/{MANIFEST}")  # invisible first
            self.blob.rm(self._dir(v))
        for v, name in self._all_dirs():
            if v < just_published and v not in published:
                log.debug("removing unpublished debris weights/%s", name)
                self.blob.rm(f"weights/{name}")
