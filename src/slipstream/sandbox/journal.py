"""Crash safety: a journal of live sandboxes, and reaping of what a crashed owner left behind.

The journal is a directory (`<state_dir>/journal/`) with one JSON file per live sandbox, written
atomically (temp file + rename) *before* the sandbox's processes start (cgroup paths and dirs are
known then) and updated with the pid once it runs; the file goes away after the sandbox is
destroyed. Each file names its owner (pid + /proc start time).

Trust: reaping kills processes and removes cgroups and directories named in the records, as
whoever runs it (often root), so a record is acted on only when this user wrote it. The state dir
and the journal are private runtime directories (`slipstream.rundir`: owned by us, not writable by
others, no symlinks; a directory someone else made first is refused, naming it), every file is
opened relative to the checked directory fd with O_NOFOLLOW, and each record carries an HMAC-SHA256
under a random per-journal key (`.key`, mode 0600, in the 0700 journal dir): a record without a
valid MAC (planted, edited, or from before this check) is logged and removed, never acted on.

`reap_orphans()` reaps every record whose owner is dead: kills the recorded process (only if
its start time still matches, so a recycled pid is never hit), kills and removes its cgroups,
deletes its dirs, and lets the backend remove anything else (VMs: sockets, images, jailer dirs)
through `Backend.reap`.

Not covered: processes of the `process` backend that left the agent's cgroup-less process tree
(that backend is not isolation and has no cgroup), a journal on a filesystem shared by hosts,
records of a version before the MAC (removed unreaped: reap with that version before upgrading),
journals in the old default dir /tmp/slipstream-sandbox-<uid> (no longer read).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import secrets
import shutil
import signal
import weakref
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from slipstream.rundir import (
    UnsafeDirError,
    create_once_at,
    list_at,
    open_dir,
    private_dir,
    process_alive,
    process_start_ticks,
    read_at,
    runtime_root,
    unlink_at,
    write_at,
)
from slipstream.sandbox.cgroups import remove_cgroup_dirs

log = logging.getLogger(__name__)


@dataclass
class SandboxRecord:
    """What the crash journal keeps about a live sandbox so that a later process can reap it."""

    sandbox_id: str
    backend: str
    pid: int | None = None
    pid_start_ticks: int | None = None
    """/proc/PID/stat starttime: guards against killing a recycled pid."""
    cgroup_paths: list[str] = field(default_factory=list)
    dirs: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)


def default_state_dir() -> Path:
    """This user's sandbox state dir: `<rundir.runtime_root()>/sandbox` (never a shared /tmp name)."""
    return runtime_root() / "sandbox"


RECORD_MAX_BYTES = 1 << 20
"""A record names a few paths and cgroups; anything bigger is not one of ours."""
KEY_FILE = ".key"


def _mac(key: bytes, data: dict[str, Any]) -> str:
    body = json.dumps({k: v for k, v in data.items() if k != "mac"}, sort_keys=True)
    return hmac.new(key, body.encode(), hashlib.sha256).hexdigest()


class Journal:
    """One JSON file per live sandbox under `<state_dir>/journal`. Owned by this process.
    Raises rundir.UnsafeDirError (naming the directory) when the state dir or the journal is not
    private to this user."""

    def __init__(self, state_dir: str | Path) -> None:
        # work/ and jailer/ live in the state dir too: searchable by others, not writable
        private_dir(state_dir, mode=0o755)
        self.dir = private_dir(Path(state_dir) / "journal", mode=0o700)
        self._fd = open_dir(self.dir)
        weakref.finalize(self, os.close, self._fd)
        create_once_at(self._fd, KEY_FILE, secrets.token_bytes(32))
        self._key = read_at(self._fd, KEY_FILE, max_bytes=64)
        if len(self._key) != 32:
            raise UnsafeDirError(f"journal key {self.dir / KEY_FILE} is not 32 bytes; remove it")
        self.owner_pid = os.getpid()
        self.owner_start = process_start_ticks(self.owner_pid)

    def write(self, record: SandboxRecord) -> None:
        data: dict[str, Any] = {
            "owner_pid": self.owner_pid,
            "owner_start": self.owner_start,
            **asdict(record),
        }
        data["mac"] = _mac(self._key, data)
        write_at(self._fd, f"{record.sandbox_id}.json", json.dumps(data).encode())

    def remove(self, sandbox_id: str) -> None:
        unlink_at(self._fd, f"{sandbox_id}.json")

    def entries(self) -> list[dict[str, Any]]:
        """Records this user's journal wrote (MAC checked); anything else is logged and removed."""
        out = []
        for name in list_at(self._fd):
            if not name.endswith(".json") or name.startswith("."):
                continue
            try:
                data = json.loads(read_at(self._fd, name, RECORD_MAX_BYTES))
                if not isinstance(data, dict) or not hmac.compare_digest(
                    str(data.get("mac", "")), _mac(self._key, data)
                ):
                    raise ValueError("no valid MAC: not written by this user's journal")
            except FileNotFoundError:
                continue  # removed by its owner while we listed
            except (ValueError, UnsafeDirError, OSError) as e:
                log.warning("journal entry %s ignored and removed: %s", self.dir / name, e)
                unlink_at(self._fd, name)
                continue
            out.append({k: v for k, v in data.items() if k != "mac"})
        return out

    def orphans(self) -> list[dict[str, Any]]:
        """Entries whose owner process is dead (never this process's own)."""
        return [
            e
            for e in self.entries()
            if (e["owner_pid"], e.get("owner_start")) != (self.owner_pid, self.owner_start)
            and not process_alive(e["owner_pid"], e.get("owner_start"))
        ]

    def reap_orphans(
        self, reaper_for: Callable[[str], Callable[[SandboxRecord], list[str]]]
    ) -> int:
        """Reap every orphaned entry with `reaper_for(backend_name)(record)`; returns the count."""
        n = 0
        for entry in self.orphans():
            fields = {k: v for k, v in entry.items() if k not in ("owner_pid", "owner_start")}
            record = SandboxRecord(**fields)
            done = reaper_for(record.backend)(record)
            log.warning(
                "reaped orphaned sandbox %s (%s): %s", record.sandbox_id, record.backend, done
            )
            self.remove(record.sandbox_id)
            n += 1
        return n


def reap_record(record: SandboxRecord) -> list[str]:
    """Kill the recorded process (if it is still the same one), remove cgroups (killing every
    member) and dirs. Idempotent; returns what it did."""
    done = []
    if record.pid and process_alive(record.pid, record.pid_start_ticks):
        try:
            os.kill(record.pid, signal.SIGKILL)
            done.append(f"killed pid {record.pid}")
        except ProcessLookupError:
            pass
    if record.cgroup_paths:
        remove_cgroup_dirs(record.cgroup_paths)
        done.append(f"removed cgroups {record.cgroup_paths}")
    for d in record.dirs:
        if os.path.lexists(d):
            shutil.rmtree(d, ignore_errors=True)
            done.append(f"removed {d}")
    return done
