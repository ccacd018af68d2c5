"""Crash safety: a journal of live sandboxes, and reaping of what a crashed owner left behind.

The journal is a directory (`<state_dir>/journal/`) with one JSON file per live sandbox, written
atomically (temp file + rename) *before* the sandbox's processes start (cgroup paths and dirs are
known then) and updated with the pid once it runs; the file goes away after the sandbox is
destroyed. Each file names its owner (pid + /proc start time). `reap_orphans()` reaps every record
whose owner is dead: kills the recorded process (only if its start time still matches, so a recycled
pid is never hit), kills and removes its cgroups, deletes its dirs, and lets the backend remove
anything else (VMs: sockets, images, jailer dirs) through `Backend.reap`.

Not covered: processes of the `process` backend that left the agent's cgroup-less process tree
(that backend is not isolation and has no cgroup), a journal on a filesystem shared by hosts.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

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


def process_start_ticks(pid: int) -> int | None:
    """Field 22 of /proc/PID/stat (start time in clock ticks), None if the process is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return int(stat[stat.rfind(")") + 2 :].split()[19])


def process_alive(pid: int | None, start_ticks: int | None) -> bool:
    if not pid:
        return False
    now = process_start_ticks(pid)
    return now is not None and (start_ticks is None or now == start_ticks)


def default_state_dir() -> Path:
    base = os.environ.get("XDG_RUNTIME_DIR") or "/tmp"
    return Path(base) / f"slipstream-sandbox-{os.getuid()}"


class Journal:
    """One JSON file per live sandbox under `<state_dir>/journal`. Owned by this process."""

    def __init__(self, state_dir: str | Path) -> None:
        self.dir = Path(state_dir) / "journal"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.owner_pid = os.getpid()
        self.owner_start = process_start_ticks(self.owner_pid)

    def _path(self, sandbox_id: str) -> Path:
        return self.dir / f"{sandbox_id}.json"

    def write(self, record: SandboxRecord) -> None:
        data = {"owner_pid": self.owner_pid, "owner_start": self.owner_start, **asdict(record)}
        tmp = self.dir / f".{record.sandbox_id}.tmp"
        tmp.write_text(json.dumps(data))
        os.replace(tmp, self._path(record.sandbox_id))

    def remove(self, sandbox_id: str) -> None:
        self._path(sandbox_id).unlink(missing_ok=True)

    def entries(self) -> list[dict[str, Any]]:
        out = []
        for p in sorted(self.dir.glob("*.json")):
            try:
                out.append(json.loads(p.read_text()))
            except (json.JSONDecodeError, FileNotFoundError) as e:
                log.warning("journal entry %s unreadable (%s); removing it", p, e)
                p.unlink(missing_ok=True)
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
