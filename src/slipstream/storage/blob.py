"""BlobStore: a URL root (a plain path, file://, s3://) on an fsspec filesystem, and the
manifest-last rule every store in slipstream follows.

Contract:
- `write_manifested(blob, prefix, files, meta)` writes the files first and `manifest.json` LAST,
  in one atomic step (a rename on local disks, a single PUT on S3); the manifest lists every file
  with its size and sha256. An entry (a weight version, a checkpoint) exists iff its manifest does.
- `read_manifested` checks every file against the manifest (size and hash) and raises OSError
  naming the file on a mismatch: a publish that died half-way is never read as complete.

Not covered: several writers to one URL (one trainer writes), authenticity (the hashes guard
against corruption, not against someone who can write the store).
"""

from __future__ import annotations

import hashlib
import json
import time
from typing import Any

import fsspec

MANIFEST = "manifest.json"


class BlobStore:
    """A URL root on an fsspec filesystem with the few operations the store and checkpoints need.
    `storage_options` go to fsspec (e.g. {"client_kwargs": {"endpoint_url": ...}} for S3)."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        if not url:
            raise ValueError("store url is empty")
        self.url = url
        self.storage_options = dict(storage_options or {})
        self.fs, root = fsspec.core.url_to_fs(url, **self.storage_options)
        self.root = root.rstrip("/")
        self.local = "file" in (
            self.fs.protocol if isinstance(self.fs.protocol, tuple) else (self.fs.protocol,)
        )
        if self.local:
            self.fs.makedirs(self.root, exist_ok=True)

    def path(self, rel: str) -> str:
        return f"{self.root}/{rel}"

    def url_of(self, rel: str) -> str:
        """`rel` as a local path (local stores) or a URL with the store's scheme (s3://...)."""
        path = self.path(rel)
        return path if self.local else self.fs.unstrip_protocol(path)

    def sizes(self, rel: str) -> dict[str, int]:
        """Relative path -> bytes of every file below `rel` ({} when missing)."""
        self.fs.invalidate_cache()
        base = self.path(rel).rstrip("/")
        try:
            found = self.fs.find(base, detail=True)
        except FileNotFoundError:
            return {}
        return {name[len(base) + 1 :]: int(info["size"]) for name, info in found.items()}

    def put(self, rel: str, data: bytes) -> None:
        if self.local:
            self.fs.makedirs(self.path(rel).rsplit("/", 1)[0], exist_ok=True)
        self.fs.pipe_file(self.path(rel), data)

    def put_atomic(self, rel: str, data: bytes) -> None:
        """Readers see the old object or the whole new one, never a prefix."""
        if self.local:
            tmp = f"{rel}.tmp-{time.time_ns()}"
            self.put(tmp, data)
            self.fs.mv(self.path(tmp), self.path(rel))
        else:
            self.put(rel, data)  # an S3 PUT is atomic

    def get(self, rel: str) -> bytes:
        return self.fs.cat_file(self.path(rel))

    def exists(self, rel: str) -> bool:
        return self.fs.exists(self.path(rel))

    def listdir(self, rel: str) -> list[str]:
        """Names (not paths) directly under rel; [] when missing."""
        self.fs.invalidate_cache()
        try:
            entries = self.fs.ls(self.path(rel), detail=False)
        except FileNotFoundError:
            return []
        return sorted({e.rstrip("/").rsplit("/", 1)[-1] for e in entries})

    def rm(self, rel: str) -> None:
        try:
            self.fs.rm(self.path(rel), recursive=True)
        except FileNotFoundError:
            pass


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def write_manifested(
    blob: BlobStore, prefix: str, files: dict[str, bytes], meta: dict[str, Any]
) -> None:
    """Write `files` under prefix, then the manifest (with sizes, hashes and `meta`) last."""
    for name, data in files.items():
        blob.put(f"{prefix}/{name}", data)
    manifest = dict(meta)
    manifest["files"] = {n: {"bytes": len(d), "sha256": _sha256(d)} for n, d in files.items()}
    manifest["written_unix_s"] = time.time()
    blob.put_atomic(f"{prefix}/{MANIFEST}", json.dumps(manifest, indent=1).encode())


def read_manifested(blob: BlobStore, prefix: str) -> tuple[dict[str, Any], dict[str, bytes]]:
    """(manifest, files) with every file checked against the manifest; raises on mismatch."""
    manifest = json.loads(blob.get(f"{prefix}/{MANIFEST}"))
    files = {}
    for name, info in manifest["files"].items():
        data = blob.get(f"{prefix}/{name}")
        if len(data) != info["bytes"] or _sha256(data) != info["sha256"]:
            raise OSError(f"{blob.url}/{prefix}/{name} does not match its manifest")
        files[name] = data
    return manifest, files
