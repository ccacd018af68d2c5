"""One small interface over cgroup v1 (one hierarchy per controller) and cgroup v2 (unified).

`CgroupManager.detect()` finds the layout: v2 when `<root>/cgroup.controllers` exists, v1 when
`<root>/memory` is a mounted controller. Sandbox cgroups live under a `slipstream` parent: in v1
below the calling process's own cgroup in each hierarchy (so an outer limit still applies), in v2
below the root (controllers can only be enabled where no process lives).

A `Cgroup` applies memory (+swap in v1 when available, so a memory bomb is OOM-killed rather than
swapped), pids, cpuset (cpus, mems) and a CPU quota of `vcpus` CPUs; it counts OOM kills (v1
`memory.oom_control` oom_kill, v2 `memory.events` oom_kill), reports peak memory (v1
`memory.max_usage_in_bytes`, reset per exec; v2 `memory.peak`, since creation on kernels that cannot
reset it), kills every member and removes itself.

`Cgroup.enter_fn()` returns a fork-safe callable that moves the calling process into the cgroup;
the QEMU backend runs it in the child between fork and exec so no sandboxed code ever runs outside.
`Cgroup.procs_files()` names the files to write a pid into: bwrap's exec chain writes them from a
shell before it execs bwrap (no fork of the caller; bwrap.py).

Not covered: io limits, cgroup v1 without the pids or cpuset controller (logged, skipped),
delegated non-root v2 subtrees other than an explicit `parent` argument.
"""

from __future__ import annotations

import errno
import logging
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from slipstream.sandbox.host_topology import format_cpulist

log = logging.getLogger(__name__)

V1_CONTROLLERS = ("memory", "pids", "cpuset", "cpu")
V2_CONTROLLERS = ("memory", "pids", "cpuset", "cpu")
CFS_PERIOD_US = 100_000


@dataclass(frozen=True)
class CgroupLimits:
    memory_bytes: int
    pids_max: int
    vcpus: int
    cpus: tuple[int, ...] | None = None
    mems: tuple[int, ...] | None = None


def _write(path: Path, value: str) -> None:
    try:
        path.write_text(value)
    except OSError as e:
        raise OSError(e.errno, f"cannot write {value!r} to {path}: {e.strerror}") from None


def _read_int_field(path: Path, key: str) -> int:
    try:
        text = path.read_text()
    except FileNotFoundError:
        return 0
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] == key:
            return int(parts[1])
    return 0


class Cgroup:
    """One sandbox's cgroup: a directory per v1 hierarchy, or one v2 directory."""

    def __init__(self, version: int, paths: dict[str, Path]) -> None:
        self.version = version
        self.paths = paths  # controller -> dir (v2: every controller -> the same dir)

    @property
    def dirs(self) -> list[str]:
        return sorted({str(p) for p in self.paths.values()})

    def _dir(self, controller: str) -> Path | None:
        return self.paths.get(controller)

    def procs_files(self) -> list[str]:
        """The cgroup.procs file of every hierarchy this cgroup spans (one on v2, one per
        controller on v1): a process that writes its pid into each is inside the cgroup."""
        return [os.path.join(d, "cgroup.procs") for d in self.dirs]

    def enter_fn(self) -> Callable[[], None]:
        """A callable for a forked child: writes its pid into every cgroup.procs (os calls only)."""
        procs_files = self.procs_files()

        def enter() -> None:
            pid = str(os.getpid()).encode()
            for f in procs_files:
                fd = os.open(f, os.O_WRONLY)
                try:
                    os.write(fd, pid)
                finally:
                    os.close(fd)

        return enter

    def apply(self, limits: CgroupLimits, parent_cpus: str, parent_mems: str) -> None:
        mem = str(limits.memory_bytes)
        cpus = format_cpulist(limits.cpus) if limits.cpus else parent_cpus
        mems = format_cpulist(limits.mems) if limits.mems else parent_mems
        quota = str(limits.vcpus * CFS_PERIOD_US)
        if self.version == 1:
            if d := self._dir("cpuset"):  # cpus/mems first: v1 refuses tasks while they are empty
                _write(d / "cpuset.cpus", cpus)
                _write(d / "cpuset.mems", mems)
            if d := self._dir("memory"):
                _write(d / "memory.limit_in_bytes", mem)
                if (d / "memory.memsw.limit_in_bytes").exists():
                    _write(d / "memory.memsw.limit_in_bytes", mem)
                if (d / "memory.swappiness").exists():
                    _write(d / "memory.swappiness", "0")
            if d := self._dir("pids"):
                _write(d / "pids.max", str(limits.pids_max))
            if d := self._dir("cpu"):
                _write(d / "cpu.cfs_period_us", str(CFS_PERIOD_US))
                _write(d / "cpu.cfs_quota_us", quota)
        else:
            d = self.paths["memory"]
            _write(d / "memory.max", mem)
            if (d / "memory.swap.max").exists():
                _write(d / "memory.swap.max", "0")
            _write(d / "pids.max", str(limits.pids_max))
            if (d / "cpuset.cpus").exists():
                _write(d / "cpuset.cpus", cpus)
                _write(d / "cpuset.mems", mems)
            if (d / "cpu.max").exists():
                _write(d / "cpu.max", f"{quota} {CFS_PERIOD_US}")

    def set_cpu_weight(self, weight: int) -> None:
        """CPU weight relative to siblings (v2 `cpu.weight` scale: 1..10000, default 100; v1
        `cpu.shares` = weight x 10.24). Used to start sandboxes in the background (weight 1)."""
        d = self._dir("cpu")
        if d is None:
            return
        if self.version == 1:
            _write(d / "cpu.shares", str(max(2, weight * 1024 // 100)))
        elif (d / "cpu.weight").exists():
            _write(d / "cpu.weight", str(max(1, min(10000, weight))))

    def oom_kills(self) -> int:
        d = self._dir("memory")
        if d is None:
            return 0
        if self.version == 1:
            return _read_int_field(d / "memory.oom_control", "oom_kill")
        return _read_int_field(d / "memory.events", "oom_kill")

    def pids_max_hits(self) -> int:
        """Forks and thread starts refused at pids.max (`pids.events` "max", v1 and v2 alike)."""
        d = self._dir("pids")
        return 0 if d is None else _read_int_field(d / "pids.events", "max")

    def reset_peak_memory(self) -> None:
        d = self._dir("memory")
        if d is not None and self.version == 1:
            try:
                (d / "memory.max_usage_in_bytes").write_text("0")
            except OSError as e:
                log.debug("cannot reset %s: %s", d, e)

    def peak_memory_bytes(self) -> int | None:
        d = self._dir("memory")
        if d is None:
            return None
        name = "memory.max_usage_in_bytes" if self.version == 1 else "memory.peak"
        try:
            return int((d / name).read_text())
        except (OSError, ValueError):
            return None

    def pids(self) -> list[int]:
        return cgroup_pids(self.dirs)

    def kill_and_remove(self, timeout_s: float = 10.0) -> None:
        remove_cgroup_dirs(self.dirs, timeout_s)


def cgroup_pids(dirs: list[str]) -> list[int]:
    found: set[int] = set()
    for d in dirs:
        try:
            found.update(int(x) for x in Path(d, "cgroup.procs").read_text().split())
        except FileNotFoundError:
            continue
    return sorted(found)


def remove_cgroup_dirs(dirs: list[str], timeout_s: float = 10.0) -> None:
    """SIGKILL every member of these cgroup dirs, wait until they are gone, rmdir them.
    Missing dirs are fine (idempotent). Raises OSError naming the dir if it cannot be removed."""
    deadline = time.monotonic() + timeout_s
    for d in dirs:
        kill_file = Path(d, "cgroup.kill")
        if kill_file.exists():
            try:
                kill_file.write_text("1")
            except OSError as e:
                log.debug("cgroup.kill on %s: %s", d, e)
    while True:
        pids = cgroup_pids(dirs)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        busy = []
        for d in dirs:
            try:
                os.rmdir(d)
            except FileNotFoundError:
                pass
            except OSError as e:
                if e.errno != errno.EBUSY:
                    raise OSError(e.errno, f"cannot remove cgroup {d}: {e.strerror}") from None
                busy.append(d)
        if not busy:
            return
        if time.monotonic() > deadline:
            raise OSError(errno.EBUSY, f"cgroups still busy after {timeout_s} s: {busy}")
        dirs = busy
        time.sleep(0.005)


class CgroupManager:
    """Creates sandbox cgroups under `<hierarchy>/.../slipstream`."""

    def __init__(self, version: int, parents: dict[str, Path]) -> None:
        self.version = version
        self.parents = parents  # controller -> parent dir for sandbox cgroups
        self._parent_cpus, self._parent_mems = self._init_parents()

    @classmethod
    def detect(cls, root: str | Path = "/sys/fs/cgroup", name: str = "slipstream") -> CgroupManager:
        """The layout of this host. Raises OSError naming what is missing or not writable."""
        root = Path(root)
        if (root / "cgroup.controllers").exists():
            available = (root / "cgroup.controllers").read_text().split()
            missing = [c for c in ("memory", "pids") if c not in available]
            if missing:
                raise OSError(errno.ENOTSUP, f"cgroup v2 at {root} lacks controllers {missing}")
            return cls(2, {c: root / name for c in V2_CONTROLLERS})
        if not (root / "memory").is_dir():
            raise OSError(errno.ENOENT, f"no cgroup v2 and no v1 memory hierarchy under {root}")
        own = _own_v1_paths()
        parents = {}
        for c in V1_CONTROLLERS:
            if (root / c).is_dir():
                parents[c] = root / c / own.get(c, "").lstrip("/") / name
            else:
                log.warning("cgroup v1 controller %s not mounted under %s; not limited", c, root)
        return cls(1, parents)

    def _init_parents(self) -> tuple[str, str]:
        if self.version == 2:
            parent = self.parents["memory"]
            wanted = [c for c in V2_CONTROLLERS]
            _enable_v2(parent.parent, wanted)
            parent.mkdir(exist_ok=True)
            _enable_v2(parent, wanted)
            cpus = _read_first(
                parent / "cpuset.cpus.effective", parent.parent / "cpuset.cpus.effective"
            )
            mems = _read_first(
                parent / "cpuset.mems.effective", parent.parent / "cpuset.mems.effective"
            )
            return cpus, mems
        for c, parent in self.parents.items():
            parent.mkdir(parents=True, exist_ok=True)
            if c == "memory" and (parent / "memory.use_hierarchy").exists():
                try:
                    (parent / "memory.use_hierarchy").write_text("1")
                except OSError as e:
                    log.debug("memory.use_hierarchy on %s: %s", parent, e)
        cpus = mems = ""
        if p := self.parents.get("cpuset"):
            cpus = (p.parent / "cpuset.cpus").read_text().strip()
            mems = (p.parent / "cpuset.mems").read_text().strip()
            if not (p / "cpuset.cpus").read_text().strip():
                _write(p / "cpuset.cpus", cpus)
            if not (p / "cpuset.mems").read_text().strip():
                _write(p / "cpuset.mems", mems)
        return cpus, mems

    @property
    def parent_dirs(self) -> list[str]:
        return sorted({str(p) for p in self.parents.values()})

    def create(self, name: str, limits: CgroupLimits) -> Cgroup:
        paths = {c: p / name for c, p in self.parents.items()}
        created = []
        try:
            for d in sorted(set(paths.values())):
                d.mkdir()
                created.append(str(d))
            cg = Cgroup(self.version, paths)
            cg.apply(limits, self._parent_cpus, self._parent_mems)
        except OSError:
            remove_cgroup_dirs(created)
            raise
        return cg

    def leftover_dirs(self) -> list[str]:
        """Sandbox cgroups that exist under the parents now (for tests and doctor)."""
        out = []
        for p in set(self.parents.values()):
            if p.is_dir():
                out.extend(str(c) for c in p.iterdir() if c.is_dir())
        return sorted(out)


def _read_first(*paths: Path) -> str:
    for p in paths:
        try:
            text = p.read_text().strip()
        except FileNotFoundError:
            continue
        if text:
            return text
    return ""


def _enable_v2(d: Path, controllers: list[str]) -> None:
    avail = (d / "cgroup.controllers").read_text().split()
    enabled = (d / "cgroup.subtree_control").read_text().split()
    todo = [c for c in controllers if c in avail and c not in enabled]
    if todo:
        _write(d / "cgroup.subtree_control", " ".join("+" + c for c in todo))


def _own_v1_paths() -> dict[str, str]:
    """controller -> this process's cgroup path in that v1 hierarchy (from /proc/self/cgroup)."""
    out = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, ctrls, path = line.split(":", 2)
        for c in ctrls.split(","):
            if c:
                out[c] = path
    return out
