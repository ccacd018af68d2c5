"""One writer per store: a lock object with owner, host, pid and heartbeat, on local disk and on
S3, and the job-level locks of `slipstream run` / `slipstream sft`.

    with job_locks(cfg, owner="slipstream run") as locks:   # run.output_dir, then store.url
        ...                                                 # StoreLocked if another job runs
    lock = StoreLock(blob, owner="...", ttl_s=60); lock.acquire(); ...; lock.release()

The lock is one small JSON object (`<store>/lock.json`; `<run.output_dir>/.slipstream-lock.json`
for the output directory) naming its owner, host, pid (+ its start time, boot id and pid
namespace), a random token, the TTL and the last heartbeat. A background thread rewrites it
every `heartbeat_s` (TTL / 4). Every change is a compare-and-swap on the object's version, so two
jobs never both believe they hold it:

- local disk (and file:// on a shared mount): create = write a temporary file and hard-link it
  into place (fails if the lock exists); replace and delete compare the file's inode, mtime and
  size under an `flock` on `<lock>.guard`, held for the few microseconds of the swap.
- S3: conditional requests: create = PUT with `If-None-Match: *`, replace = PUT with
  `If-Match: <our ETag>` (AWS since 2024, MinIO, moto). A server that answers those with
  NotImplemented gets the fallback: write, wait `settle_s`, read back and compare (the token
  makes each write unique); a race lost there is then caught at the latest by the next heartbeat,
  which reads the lock and stops the job when the token is not its own.
- any other fsspec filesystem: the write-then-read-back fallback.

A second job is refused with `StoreLocked` naming the holder ("held by 'slipstream run' pid 123
on host h, last heartbeat 4 s ago"). A lock is stale, and is taken over with a warning in the log
(and `took_over` for the run's report), when its heartbeat is older than the TTL (the larger of
the holder's and ours), or at once when the holder ran on this machine (same host, boot id and pid
namespace) and its process is gone (a job killed with SIGKILL restarts without waiting). A holder
that finds its lock taken over (it was frozen past the TTL) stops: its heartbeat thread logs the
new owner, fences the store (every later write through a BlobStore on it raises `LockLost`) and
sends the process SIGTERM (the job's drain handler). An unreadable lock object (not JSON) is
never taken over automatically: the message says to remove it.

Not covered: clocks that disagree across hosts by more than the TTL (heartbeat ages are wall
clock), S3-compatible servers that silently ignore conditional headers *and* writers racing
within `settle_s` (caught by the next heartbeat, not before), a holder frozen past the TTL
that writes once more between waking and its next heartbeat (its fence is raised at that beat).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import secrets
import signal
import socket
import stat
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from slipstream.rundir import process_alive, process_start_ticks
from slipstream.storage.blob import BlobStore, clear_fence, set_fence, with_path
from slipstream.storage.errors import InvalidEntry, LockLost, StoreLocked

if TYPE_CHECKING:
    from slipstream.config import SlipstreamConfig

log = logging.getLogger(__name__)

LOCK_FILE = "lock.json"
OUTPUT_DIR_LOCK_FILE = ".slipstream-lock.json"
DEFAULT_TTL_S = 60.0
S3_SETTLE_S = 2.0
_ATTEMPTS = 8

Etag = Any  # an opaque version of the lock object: (inode, mtime_ns, size) or an S3 ETag


# ---- who am I -------------------------------------------------------------------------------


def _read_text(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _pid_namespace() -> str | None:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def machine_identity() -> dict[str, Any]:
    """host, pid, pid start time, boot id and pid namespace of this process."""
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "pid_start_ticks": process_start_ticks(os.getpid()),
        "boot_id": _read_text("/proc/sys/kernel/random/boot_id"),
        "pid_namespace": _pid_namespace(),
    }


def _same_machine(rec: dict[str, Any]) -> bool:
    me = machine_identity()
    return all(rec.get(k) == me[k] and me[k] is not None
               for k in ("host", "boot_id", "pid_namespace"))  # fmt: skip


def _process_gone(rec: dict[str, Any]) -> bool:
    """True only when the holder ran on this machine and its process no longer exists."""
    pid = rec.get("pid")
    if not _same_machine(rec) or type(pid) is not int or pid <= 0:
        return False
    return not process_alive(pid, rec.get("pid_start_ticks"))


# ---- compare-and-swap on one object ---------------------------------------------------------


class _LocalIO:
    """The lock file on a local (or mounted) filesystem."""

    def __init__(self, blob: BlobStore, name: str) -> None:
        self.path = blob.path(name)
        self.guard_path = f"{self.path}.guard"

    @contextlib.contextmanager
    def _guard(self) -> Iterator[None]:
        fd = os.open(self.guard_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK
                     | os.O_CLOEXEC, 0o644)  # fmt: skip
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise InvalidEntry(f"{self.guard_path}: not a regular file")
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the flock

    @staticmethod
    def _etag(st: os.stat_result) -> Etag:
        return (st.st_ino, st.st_mtime_ns, st.st_size)

    def _read(self) -> tuple[bytes, Etag] | None:
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise InvalidEntry(f"{self.path}: the lock is not a regular file")
            os.set_blocking(fd, True)
            data = os.read(fd, 1 << 20)
            return data, self._etag(st)
        finally:
            os.close(fd)

    def read(self) -> tuple[bytes, Etag] | None:
        with self._guard():
            return self._read()

    def _write_tmp(self, data: bytes) -> str:
        tmp = f"{self.path}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        return tmp

    def create(self, data: bytes) -> Etag | None:
        with self._guard():
            tmp = self._write_tmp(data)
            try:
                os.link(tmp, self.path)  # atomic create-if-absent, content complete
            except FileExistsError:
                return None
            finally:
                os.unlink(tmp)
            return self._etag(os.stat(self.path))

    def replace(self, data: bytes, etag: Etag) -> Etag | None:
        with self._guard():
            cur = self._read()
            if cur is None or cur[1] != etag:
                return None
            os.replace(self._write_tmp(data), self.path)
            return self._etag(os.stat(self.path))

    def delete(self, etag: Etag) -> bool:
        with self._guard():
            cur = self._read()
            if cur is None or cur[1] != etag:
                return False
            os.unlink(self.path)
            return True


def _s3_error_code(e: BaseException) -> str | None:
    """The S3 error code behind an s3fs-translated exception (PreconditionFailed, ...): that of
    the botocore ClientError it was raised from."""
    try:
        from botocore.exceptions import ClientError
    except ModuleNotFoundError:  # no S3 support installed: no S3 error either
        return None
    seen: BaseException | None = e
    for _ in range(4):
        if seen is None:
            return None
        if isinstance(seen, ClientError):
            return str(seen.response.get("Error", {}).get("Code"))
        seen = seen.__cause__ or seen.__context__
    return None


_LOST_RACE = {"PreconditionFailed", "412", "ConditionalRequestConflict", "409", "NoSuchKey"}
_UNSUPPORTED = {"NotImplemented", "501", "InvalidArgument", "InvalidRequest"}


class _S3IO:
    """The lock object on S3 with conditional PUTs (fallback: write, settle, read back)."""

    def __init__(self, blob: BlobStore, name: str, settle_s: float, conditional: bool) -> None:
        self.fs = blob.fs
        self.url = blob.url_of(name)
        self.bucket, self.key, _ = self.fs.split_path(blob.path(name))
        self.settle_s = settle_s
        self.conditional = conditional

    def read(self) -> tuple[bytes, Etag] | None:
        from fsspec.asyn import sync

        async def get() -> tuple[bytes, Etag]:
            resp = await self.fs._call_s3("get_object", Bucket=self.bucket, Key=self.key)
            try:
                return await resp["Body"].read(), resp["ETag"]
            finally:
                resp["Body"].close()

        try:
            return sync(self.fs.loop, get)
        except FileNotFoundError:
            return None

    def _put(self, data: bytes, **condition: str) -> Etag | None:
        try:
            resp = self.fs.call_s3("put_object", Bucket=self.bucket, Key=self.key, Body=data,
                                   **condition)  # fmt: skip
        except (FileExistsError, FileNotFoundError):
            return None  # If-None-Match: the lock exists / If-Match: it was deleted
        except OSError as e:
            code = _s3_error_code(e)
            if code in _LOST_RACE:
                return None
            if code in _UNSUPPORTED and condition:
                log.warning("%s: the S3 server refuses conditional writes (%s); falling back "
                            "to write-then-read-back for the lock", self.url, code)  # fmt: skip
                self.conditional = False
                raise _Unsupported from None
            raise
        return resp.get("ETag")

    def _readback(self, data: bytes) -> Etag | None:
        time.sleep(self.settle_s)
        cur = self.read()
        return cur[1] if cur is not None and cur[0] == data else None

    def create(self, data: bytes) -> Etag | None:
        if self.conditional:
            try:
                return self._put(data, IfNoneMatch="*")
            except _Unsupported:
                pass
        if self.read() is not None:
            return None
        self._put(data)
        return self._readback(data)

    def replace(self, data: bytes, etag: Etag) -> Etag | None:
        if self.conditional:
            try:
                return self._put(data, IfMatch=etag)
            except _Unsupported:
                pass
        cur = self.read()
        if cur is None or cur[1] != etag:
            return None
        self._put(data)
        return self._readback(data)

    def delete(self, etag: Etag) -> bool:
        cur = self.read()
        if cur is None or cur[1] != etag:
            return False
        self.fs.call_s3("delete_object", Bucket=self.bucket, Key=self.key)
        return True


class _Unsupported(Exception):
    """The server refused a conditional request as unsupported."""


class _ReadbackIO:
    """Any other fsspec filesystem: plain writes, each verified by reading it back."""

    def __init__(self, blob: BlobStore, name: str, settle_s: float) -> None:
        self.blob, self.name, self.settle_s = blob, name, settle_s

    def read(self) -> tuple[bytes, Etag] | None:
        try:
            data = self.blob.get(self.name)
        except FileNotFoundError:
            return None
        return data, data  # the content (with its unique token) is its own version

    def _write(self, data: bytes) -> Etag | None:
        self.blob.fs.pipe_file(self.blob.path(self.name), data)
        time.sleep(self.settle_s)
        cur = self.read()
        return cur[1] if cur is not None and cur[0] == data else None

    def create(self, data: bytes) -> Etag | None:
        return None if self.read() is not None else self._write(data)

    def replace(self, data: bytes, etag: Etag) -> Etag | None:
        cur = self.read()
        return None if cur is None or cur[1] != etag else self._write(data)

    def delete(self, etag: Etag) -> bool:
        cur = self.read()
        if cur is None or cur[1] != etag:
            return False
        self.blob.fs.rm(self.blob.path(self.name))
        return True


# ---- the lock -------------------------------------------------------------------------------


def describe(rec: dict[str, Any] | None, now: float | None = None) -> str:
    """'slipstream run' pid 123 on host h (output_dir /x), last heartbeat 4 s ago."""
    if rec is None:
        return "an unreadable lock"
    now = time.time() if now is None else now
    beat = rec.get("heartbeat_unix_s")
    age = f"{now - beat:.0f} s ago" if isinstance(beat, int | float) else "never"
    where = f" (output_dir {rec['output_dir']})" if rec.get("output_dir") else ""
    return (f"{rec.get('owner')!r} pid {rec.get('pid')} on host {rec.get('host')}{where}, "
            f"last heartbeat {age}")  # fmt: skip


class StoreLock:
    """The lock of one store (or directory). See the module docstring for the protocol.

    `owner`: what holds it (shown to whoever is refused); `extra`: more fields for the record
    (e.g. output_dir). `on_lost(err)`: called from the heartbeat thread once the lock was taken
    over (default: SIGTERM to this process). `settle_s`: the read-back delay of the fallback
    protocols (S3 without conditional writes, other filesystems)."""

    def __init__(self, blob: BlobStore, *, name: str = LOCK_FILE, owner: str = "slipstream",
                 what: str = "store", ttl_s: float = DEFAULT_TTL_S,
                 heartbeat_s: float | None = None, settle_s: float | None = None,
                 conditional: bool = True, extra: dict[str, Any] | None = None,
                 on_lost: Callable[[LockLost], None] | None = None) -> None:  # fmt: skip
        if not ttl_s > 0:
            raise ValueError(f"lock ttl_s must be > 0, got {ttl_s}")
        self.blob = blob
        self.name = name
        self.owner = owner
        self.what = what
        self.ttl_s = float(ttl_s)
        self.heartbeat_s = float(heartbeat_s) if heartbeat_s is not None else self.ttl_s / 4
        self.url = blob.url_of(name)
        settle = S3_SETTLE_S if settle_s is None else settle_s
        if blob.local:
            self.io: Any = _LocalIO(blob, name)
        elif blob.protocol in ("s3", "s3a"):
            self.io = _S3IO(blob, name, settle, conditional)
        else:
            self.io = _ReadbackIO(blob, name, settle)
        self.extra = dict(extra or {})
        self.on_lost = on_lost or _terminate_self
        self.record: dict[str, Any] | None = None
        self.took_over: dict[str, Any] | None = None
        self.lost: LockLost | None = None
        self._etag: Etag | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._mutex = threading.Lock()

    @property
    def held(self) -> bool:
        return self.record is not None and self.lost is None

    def _new_record(self) -> dict[str, Any]:
        now = time.time()
        return {"owner": self.owner, **machine_identity(), "token": secrets.token_hex(16),
                "ttl_s": self.ttl_s, "acquired_unix_s": now, "heartbeat_unix_s": now,
                "beats": 0, **self.extra}  # fmt: skip

    def _stale(self, other: dict[str, Any]) -> str | None:
        """Why the holder's lock may be taken (None: it is live)."""
        if _process_gone(other):
            return f"its process {other.get('pid')} on this machine is gone"
        beat, ttl = other.get("heartbeat_unix_s"), other.get("ttl_s")
        if not isinstance(beat, int | float):
            return None  # malformed: refused below as unreadable
        ttl = max(self.ttl_s, ttl if isinstance(ttl, int | float) and ttl > 0 else 0)
        age = time.time() - beat
        return f"its last heartbeat is {age:.0f} s old (TTL {ttl:g} s)" if age > ttl else None

    @staticmethod
    def _parse(raw: bytes) -> dict[str, Any] | None:
        try:
            rec = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
            return None
        if not isinstance(rec, dict) or not isinstance(rec.get("token"), str):
            return None
        return rec

    def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        except InvalidEntry:
            raise
        except OSError as e:
            raise with_path(e, self.url) from e

    def acquire(self) -> None:
        """Take the lock, or raise StoreLocked naming the live holder. A stale lock is taken
        over with a warning (`took_over` keeps the old holder's record and why)."""
        if self.record is not None:
            raise RuntimeError(f"{self.url}: this StoreLock is already held")
        rec = self._new_record()
        data = json.dumps(rec).encode()
        for _ in range(_ATTEMPTS):
            etag = self._call(self.io.create, data)
            if etag is not None:
                break
            cur = self._call(self.io.read)
            if cur is None:
                continue  # released meanwhile: try to create again
            other = self._parse(cur[0])
            if other is None or not isinstance(other.get("heartbeat_unix_s"), int | float):
                raise StoreLocked(
                    f"the {self.what} {self.blob.url} has a lock {self.url} that is not a valid "
                    "lock record; if no job is using it, remove that file and start again"
                )
            why = self._stale(other)
            if why is None:
                raise StoreLocked(
                    f"the {self.what} {self.blob.url} is in use by another job: lock held by "
                    f"{describe(other)} (TTL {other.get('ttl_s')} s). Stop that job, wait for "
                    f"its lock to go stale, or use another store.url / run.output_dir"
                )
            etag = self._call(self.io.replace, data, cur[1])
            if etag is not None:
                self.took_over = {**other, "reason": why}
                log.warning("%s: took over the stale lock of %s: %s", self.url,
                            describe(other), why)  # fmt: skip
                break
        else:
            raise StoreLocked(f"{self.url}: could not take the lock after {_ATTEMPTS} tries "
                              "(another job is starting on it at the same time)")  # fmt: skip
        self.record, self._etag = rec, etag
        set_fence(self.blob.fence_key, self.check)

    def check(self) -> None:
        """Raise LockLost once the lock was taken over (the store's write fence)."""
        if self.lost is not None:
            raise self.lost

    def beat(self) -> None:
        """One heartbeat: rewrite the record if it is still ours, else LockLost."""
        with self._mutex:
            self.check()
            if self.record is None:
                raise RuntimeError(f"{self.url}: heartbeat of a lock that is not held")
            rec = {**self.record, "heartbeat_unix_s": time.time(),
                   "beats": self.record["beats"] + 1}  # fmt: skip
            etag = self._call(self.io.replace, json.dumps(rec).encode(), self._etag)
            if etag is None:
                cur = self._call(self.io.read)
                other = self._parse(cur[0]) if cur is not None else None
                holder = describe(other) if other is not None else "nobody (the lock was removed)"
                self.lost = LockLost(f"{self.url}: this job ({describe(self.record)}) lost the "
                                     f"{self.what} lock; it is now held by {holder}")  # fmt: skip
                raise self.lost
            self.record, self._etag = rec, etag

    def _beat_loop(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            try:
                self.beat()
            except LockLost as e:
                log.critical("%s; stopping this job", e)
                self.on_lost(e)
                return
            except OSError as e:  # transient (network); the TTL covers missed beats
                log.warning("%s: heartbeat failed (%s); retrying in %g s", self.url, e,
                            self.heartbeat_s)  # fmt: skip

    def start_heartbeat(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._beat_loop, daemon=True,
                                            name=f"lock-heartbeat {self.url}")  # fmt: skip
            self._thread.start()

    def release(self) -> None:
        """Stop the heartbeat and delete the lock if it is still ours (idempotent)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.heartbeat_s + 30)
        with self._mutex:
            if self.record is None:
                return
            clear_fence(self.blob.fence_key, self.check)
            if self.lost is None:
                self._call(self.io.delete, self._etag)
            self.record = None

    def __enter__(self) -> StoreLock:
        self.acquire()
        self.start_heartbeat()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _terminate_self(err: LockLost) -> None:
    """Default reaction to a lost lock: SIGTERM to this process (the job drains and exits)."""
    os.kill(os.getpid(), signal.SIGTERM)


# ---- the job's locks ------------------------------------------------------------------------


@dataclass
class JobLocks:
    """The locks one job holds: its output directory's and (unless disabled) its store's."""

    locks: list[StoreLock] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        """For the run's report: which stale locks were taken over, from whom, and why."""
        return {f"{lk.what} lock taken over": f"{describe(lk.took_over)}: {lk.took_over['reason']}"
                for lk in self.locks if lk.took_over is not None}  # fmt: skip


_ACTIVE: dict[tuple[str, str], JobLocks] = {}


@contextlib.contextmanager
def job_locks(cfg: SlipstreamConfig, owner: str, *, store: bool = True,
              ttl_s: float = DEFAULT_TTL_S) -> Iterator[JobLocks]:  # fmt: skip
    """Hold the lock of `run.output_dir` and (store=True) of `store.url` for the duration.
    StoreLocked naming the holder when another job has either; NotADirectoryError when
    run.output_dir is an existing non-directory. Re-entrant within one process (a second
    `job_locks` of the same output_dir and store yields the locks already held)."""
    from slipstream.storage import storage_options

    out = Path(cfg.run.output_dir).resolve()
    key = (str(out), cfg.store.url if store else "")
    if key in _ACTIVE:
        yield _ACTIVE[key]
        return
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(errno.ENOTDIR, "run.output_dir is not a directory", str(out))
    extra = {"output_dir": str(out), "store": cfg.store.url, "command": owner}
    held = JobLocks()
    try:
        targets = [(BlobStore(str(out)), OUTPUT_DIR_LOCK_FILE, "output directory")]
        if store:
            targets.append((BlobStore(cfg.store.url, storage_options(cfg.store)), LOCK_FILE,
                            "store"))  # fmt: skip
        for blob, name, what in targets:
            lock = StoreLock(blob, name=name, owner=owner, what=what, ttl_s=ttl_s, extra=extra)
            lock.acquire()
            held.locks.append(lock)
            lock.start_heartbeat()
        _ACTIVE[key] = held
        yield held
    finally:
        _ACTIVE.pop(key, None)
        for lock in reversed(held.locks):
            lock.release()
