"""BlobStore: a URL root (a plain path, file://, s3://) on an fsspec filesystem, and the
manifest-last rule every store in slipstream follows. The store is untrusted input: anyone who
can write it (a shared bucket, a shared disk) may have put anything there.

Contract:
- `write_manifested(blob, prefix, files, meta)` writes the files first and `manifest.json` LAST,
  in one atomic step (a rename on local disks, a single PUT on S3); the manifest lists every file
  with its size and sha256. An entry (a weight version, a checkpoint) exists iff its manifest does.
- `read_manifested(blob, prefix)` validates before it trusts: the manifest must be a JSON object
  of at most `MAX_MANIFEST_BYTES` whose `files` map safe relative names (no `..`, no absolute
  paths) to a size and a sha256; each file must be listed, of that size (checked on the listing
  before any byte is read, so a huge file is never loaded), and of that hash. Any failure is an
  `InvalidEntry` (an OSError) naming the file and why. A manifest that is gone is
  `FileNotFoundError` (not published, or removed by retention meanwhile), and so is a file that
  vanished together with its manifest.
- Local reads open without blocking and read regular files only: a FIFO or a device planted in
  the store is refused (`InvalidEntry`), never waited on or read forever.
- I/O errors (ENOSPC, EACCES, EROFS, a file where a directory should be) are re-raised as the
  same OSError type carrying the store path as its filename, so one line names what failed.
- Writes are fenced: while this process holds the store's lock (storage/lock.py) and has lost
  it to another job, every write raises `LockLost` instead of writing.

Not covered: authenticity (the hashes guard against corruption, not against someone who can
write the store: they can write a consistent manifest; what is loaded is still checked by the
format readers: safetensors and JSON, never a pickle).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import stat
import time
from collections.abc import Callable, Mapping
from typing import Any

import fsspec

from slipstream.storage.errors import InvalidEntry

MANIFEST = "manifest.json"
MAX_MANIFEST_BYTES = 16 << 20
_NAME_RE = re.compile(r"[A-Za-z0-9_.-]+(/[A-Za-z0-9_.-]+)*\Z")
_SHA256_RE = re.compile(r"[0-9a-f]{64}\Z")

# Write fences, keyed by BlobStore.fence_key: a callable that raises LockLost once this process
# lost the store's lock (set by storage/lock.py while a lock is held).
_FENCES: dict[str, Callable[[], None]] = {}


def set_fence(fence_key: str, check: Callable[[], None]) -> None:
    """Every write to the store of `fence_key` (in this process) first calls `check`, which
    raises once the writer lost the store's lock."""
    _FENCES[fence_key] = check


def clear_fence(fence_key: str, check: Callable[[], None]) -> None:
    """Remove the fence `check` of `fence_key`, unless another one replaced it since."""
    if _FENCES.get(fence_key) == check:
        del _FENCES[fence_key]


def safe_name(name: Any) -> bool:
    """A relative path of plain components: no '.', '..', empty or absolute parts."""
    return (
        isinstance(name, str)
        and bool(_NAME_RE.match(name))
        and all(p not in (".", "..") for p in name.split("/"))
    )


def with_path(e: OSError, where: str) -> OSError:
    """`e` as the same OSError type with `where` as its filename (unchanged when it has one)."""
    if e.filename is not None or isinstance(e, InvalidEntry):
        return e
    strerror = e.strerror or str(e) or type(e).__name__
    try:
        new = type(e)(e.errno if e.errno is not None else errno.EIO, strerror, where)
    except TypeError:  # an OSError subclass with its own constructor (aiohttp, botocore)
        new = OSError(e.errno if e.errno is not None else errno.EIO, strerror, where)
    new.__cause__ = e
    return new


def _read_regular(path: str) -> bytes:
    """A local file's bytes; non-regular files (FIFO, device, socket, directory) are refused
    without blocking (O_NONBLOCK: opening a FIFO with no writer returns at once)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise InvalidEntry(f"{path}: not a regular file (mode {stat.filemode(st.st_mode)})")
        os.set_blocking(fd, True)
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def _write_replace(path: str, data: bytes | memoryview) -> None:
    """`data` into a new temporary file (O_EXCL: never an existing one) renamed onto `path`."""
    tmp = f"{path}.tmp-{os.getpid()}-{time.time_ns()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.close(fd)
        fd = -1
        os.replace(tmp, path)  # atomic; never moves *into* a directory
    except OSError:
        if fd >= 0:
            os.close(fd)
        os.unlink(tmp)
        raise


def _local_dirs(root: str, rel_dir: str) -> None:
    """Create root/rel_dir one component at a time, refusing a component that is a symlink or
    not a directory (a store writer could otherwise redirect our writes anywhere)."""
    path = root
    for part in [p for p in rel_dir.split("/") if p]:
        path = f"{path}/{part}"
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            try:
                os.mkdir(path)
            except FileExistsError:
                pass
            st = os.lstat(path)
        if not stat.S_ISDIR(st.st_mode):
            kind = "a symlink" if stat.S_ISLNK(st.st_mode) else "not a directory"
            raise InvalidEntry(f"{path}: {kind} inside the store; refusing to write through it")


def _refuse_links_on_the_way(root: str, rel: str, doing: str) -> None:
    """Every directory between the store root and `rel` must be a real directory: a symlinked
    `weights/` or `ckpt/` planted in the store would make a delete (or write) act in the link's
    target, outside the store. Checked before the destructive step, not after it."""
    path = root
    for part in [p for p in rel.split("/") if p][:-1]:
        path = f"{path}/{part}"
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return  # nothing below it to act on
        if not stat.S_ISDIR(st.st_mode):
            kind = "a symlink" if stat.S_ISLNK(st.st_mode) else "not a directory"
            raise InvalidEntry(f"{path}: {kind} inside the store; refusing to {doing} through it")


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
        protocols = self.fs.protocol if isinstance(self.fs.protocol, tuple) else (self.fs.protocol,)
        self.local = "file" in protocols
        self.protocol = "file" if self.local else protocols[0]
        self.fence_key = f"{self.protocol}://{self.root}"
        if self.local:
            try:
                self.fs.makedirs(self.root, exist_ok=True)
            except OSError as e:
                raise with_path(e, self.root) from e
            if not os.path.isdir(self.root):
                raise NotADirectoryError(errno.ENOTDIR, "store is not a directory", self.root)

    def path(self, rel: str) -> str:
        return f"{self.root}/{rel}"

    def url_of(self, rel: str) -> str:
        """`rel` as a local path (local stores) or a URL with the store's scheme (s3://...)."""
        path = self.path(rel)
        return path if self.local else self.fs.unstrip_protocol(path)

    def _fence(self) -> None:
        fence = _FENCES.get(self.fence_key)
        if fence is not None:
            fence()

    def sizes(self, rel: str) -> dict[str, int]:
        """Relative path -> bytes of every file below `rel` ({} when missing)."""
        self.fs.invalidate_cache()
        base = self.path(rel).rstrip("/")
        try:
            found = self.fs.find(base, detail=True)
        except FileNotFoundError:
            return {}
        except OSError as e:
            raise with_path(e, self.url_of(rel)) from e
        return {name[len(base) + 1 :]: int(info["size"]) for name, info in found.items()}

    def put(self, rel: str, data: bytes | memoryview) -> None:
        """Write `rel` whole. Local: a fresh temporary file renamed over the target, so a FIFO,
        device or symlink planted at the target is replaced, never written through, and a
        symlinked directory on the way is refused. A memoryview is written without a copy
        locally (remote filesystems get bytes)."""
        self._fence()
        try:
            if self.local:
                _local_dirs(self.root, rel.rsplit("/", 1)[0] if "/" in rel else "")
                _write_replace(self.path(rel), data)
            else:
                self.fs.pipe_file(self.path(rel), bytes(data))
        except OSError as e:
            raise with_path(e, self.url_of(rel)) from e

    def put_atomic(self, rel: str, data: bytes) -> None:
        """Readers see the old object or the whole new one, never a prefix (a rename on local
        disks, like every local `put`; a single PUT on S3)."""
        self.put(rel, data)

    def get(self, rel: str) -> bytes:
        """The bytes of `rel`. FileNotFoundError when missing; local non-regular files refused."""
        path = self.path(rel)
        try:
            return _read_regular(path) if self.local else self.fs.cat_file(path)
        except OSError as e:
            raise with_path(e, self.url_of(rel)) from e

    def exists(self, rel: str) -> bool:
        try:
            return self.fs.exists(self.path(rel))
        except OSError as e:
            raise with_path(e, self.url_of(rel)) from e

    def listdir(self, rel: str) -> list[str]:
        """Names (not paths) directly under rel; [] when missing."""
        self.fs.invalidate_cache()
        try:
            entries = self.fs.ls(self.path(rel), detail=False)
        except (FileNotFoundError, NotADirectoryError):
            return []
        except OSError as e:
            raise with_path(e, self.url_of(rel)) from e
        return sorted({e.rstrip("/").rsplit("/", 1)[-1] for e in entries})

    def rm(self, rel: str) -> None:
        self._fence()
        try:
            if self.local:
                _refuse_links_on_the_way(self.root, rel, "delete")
                if os.path.islink(self.path(rel)):
                    os.unlink(self.path(rel))  # the link, never what it points to
                    return
            self.fs.rm(self.path(rel), recursive=True)
        except FileNotFoundError:
            pass
        except OSError as e:
            raise with_path(e, self.url_of(rel)) from e


def _sha256(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


def write_manifested(
    blob: BlobStore, prefix: str, files: Mapping[str, bytes | memoryview], meta: dict[str, Any]
) -> None:
    """Write `files` under prefix, then the manifest (with sizes, hashes and `meta`) last. A
    memoryview must be of bytes (format "B": its len() is its size)."""
    for name in files:
        if not safe_name(name):
            raise ValueError(f"store file name {name!r} is not a plain relative name")
    for name, data in files.items():
        blob.put(f"{prefix}/{name}", data)
    manifest = dict(meta)
    manifest["files"] = {n: {"bytes": len(d), "sha256": _sha256(d)} for n, d in files.items()}
    manifest["written_unix_s"] = time.time()
    blob.put_atomic(f"{prefix}/{MANIFEST}", json.dumps(manifest, indent=1).encode())


def parse_manifest(where: str, raw: bytes) -> dict[str, Any]:
    """A manifest's JSON, validated: an object whose `files` maps safe names to
    {"bytes": int >= 0, "sha256": 64 hex}. InvalidEntry naming `where` otherwise."""
    try:
        manifest = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise InvalidEntry(f"{where}: manifest is not JSON ({type(e).__name__}: {e})") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        raise InvalidEntry(f"{where}: manifest is not an object with a 'files' map")
    for name, info in manifest["files"].items():
        if not safe_name(name) or name == MANIFEST:
            raise InvalidEntry(f"{where}: manifest lists an unsafe file name {name!r}")
        if not (
            isinstance(info, dict)
            and type(info.get("bytes")) is int
            and info["bytes"] >= 0
            and isinstance(info.get("sha256"), str)
            and _SHA256_RE.match(info["sha256"])
        ):
            raise InvalidEntry(f"{where}: manifest entry for {name!r} is malformed: {info!r:.200}")
    return manifest


def read_manifest(blob: BlobStore, prefix: str) -> tuple[dict[str, Any], dict[str, int]]:
    """(validated manifest, sizes of every file under prefix). FileNotFoundError if unpublished."""
    where = blob.url_of(f"{prefix}/{MANIFEST}")
    listing = blob.sizes(prefix)
    if MANIFEST not in listing:
        raise FileNotFoundError(errno.ENOENT, "no manifest (not published)", where)
    if listing[MANIFEST] > MAX_MANIFEST_BYTES:
        raise InvalidEntry(f"{where}: manifest is {listing[MANIFEST]} bytes "
                           f"(more than {MAX_MANIFEST_BYTES})")  # fmt: skip
    return parse_manifest(where, blob.get(f"{prefix}/{MANIFEST}")), listing


def read_manifested(blob: BlobStore, prefix: str) -> tuple[dict[str, Any], dict[str, bytes]]:
    """(manifest, files) with the manifest validated and every file checked against it (size on
    the listing first, then the sha256); InvalidEntry naming the file on any mismatch."""
    manifest, listing = read_manifest(blob, prefix)
    files = {}
    for name, info in manifest["files"].items():
        where = blob.url_of(f"{prefix}/{name}")
        if name not in listing:
            _gone_or_invalid(blob, prefix, where, "missing (listed in the manifest)")
        if listing[name] != info["bytes"]:
            raise InvalidEntry(f"{where}: {listing[name]} bytes, the manifest says "
                               f"{info['bytes']} (truncated or replaced)")  # fmt: skip
        try:
            data = blob.get(f"{prefix}/{name}")
        except FileNotFoundError:
            _gone_or_invalid(blob, prefix, where, "missing (listed in the manifest)")
        if len(data) != info["bytes"] or _sha256(data) != info["sha256"]:
            raise InvalidEntry(f"{where}: does not match its manifest (sha256 or size differs)")
        files[name] = data
    return manifest, files


def _gone_or_invalid(blob: BlobStore, prefix: str, where: str, why: str) -> None:
    """A listed file is missing: retention removed the whole entry meanwhile (its manifest is
    gone too: FileNotFoundError, ask again) or the entry is broken (InvalidEntry)."""
    if not blob.exists(f"{prefix}/{MANIFEST}"):
        raise FileNotFoundError(errno.ENOENT, "removed while being read", where)
    raise InvalidEntry(f"{where}: {why}")
