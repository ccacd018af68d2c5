"""What the stores raise when their input or their use is wrong (torch-free, so the CLI can catch
them without importing torch).

Every class derives from `StoreError`; `slipstream.cli.main` prints a `StoreError` as one line
(`slipstream: <message>`) and exits 1. Each message names the store URL and the file or key.

- `InvalidEntry` (an `OSError`): an entry (weight version, checkpoint) whose manifest or files
  fail validation: manifest not JSON or malformed, a file missing, truncated, of the wrong hash,
  not a regular file, or of a format that is refused (a pickle). Not raised for I/O failures
  (network, permissions): those stay ordinary `OSError`s, so a transient error is never taken
  for corruption.
- `NonFiniteTensor` (a `ValueError`): a tensor with NaN or inf values that would have been
  published or checkpointed.
- `NoValidCheckpoint` (a `ValueError`): checkpoints exist but none is valid.
- `StoreLocked`: another job holds the store's (or output directory's) lock.
- `LockLost`: this job's lock was taken over (its heartbeat went stale); it must stop writing.
"""

from __future__ import annotations


class StoreError(Exception):
    """Base of every store error; the message names the store and the file or key."""


class InvalidEntry(StoreError, OSError):
    """A store entry that fails validation (never a transient I/O error)."""

    def __init__(self, message: str) -> None:
        # OSError(message) alone: errno/filename stay None; the message names the file.
        super().__init__(message)


class NonFiniteTensor(StoreError, ValueError):
    """A NaN/inf tensor that must not be published or checkpointed."""


class NoValidCheckpoint(StoreError, ValueError):
    """Checkpoints exist in the store, but none passes validation."""


class StoreLocked(StoreError):
    """Another live job holds the lock; the message names its owner, host, pid and heartbeat."""


class LockLost(StoreError):
    """The lock this process held was taken over by another job."""


__all__ = [
    "InvalidEntry",
    "LockLost",
    "NoValidCheckpoint",
    "NonFiniteTensor",
    "StoreError",
    "StoreLocked",
]
