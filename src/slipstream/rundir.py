"""Private runtime directories: where a slipstream process keeps state that it later acts on
(the sandbox journal, the bwrap root-filesystem cache, the guest image cache, sockets).

    root = runtime_root()                       # /run/slipstream (root), $XDG_RUNTIME_DIR/slipstream, ~/.cache/slipstream/run
    d = private_dir(root / "sandbox" / "journal", mode=0o700)   # created or checked; UnsafeDirError otherwise
    fd = open_dir(d)                            # O_NOFOLLOW|O_DIRECTORY, the same checks on the open fd
    write_at(fd, "x.json", data); read_at(fd, "x.json", max_bytes=1 << 20); unlink_at(fd, "x.json")

Why: a fixed name in a shared directory (`/tmp/slipstream-sandbox-0`) can be created first by
another local user, who then owns what we read back: a planted journal record made root kill a
process, remove a cgroup and `rm -rf` a directory of the planter's choice; a squatted rootfs
cache handed every sandbox a forged guest agent. So every directory we keep state in must be:
- owned by this process's effective uid, a real directory (not a symlink), and not writable by
  group or others;
- reached only through ancestors that others cannot rename things in: each owned by root or by
  us, and either not group/other-writable or sticky (`/tmp` itself is fine: in a sticky
  directory nobody else can rename or delete our entry).
Files in it are opened relative to the checked directory's fd with O_NOFOLLOW (a name swapped
for a link afterwards is refused by the kernel, not followed) and must be regular files we own.

Not covered: another process running as the same uid (it can do anything we can), root on a
machine where we are not root, filesystems that ignore ownership (some FUSE/NFS mounts).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path


def process_start_ticks(pid: int) -> int | None:
    """Field 22 of /proc/PID/stat (start time in clock ticks), None if the process is gone.
    With the pid it names one process for good: a record that a later process acts on (a
    sandbox journal entry, a store lock) keeps both, so a recycled pid is never taken for its
    owner."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat_line = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # the command name (field 2) is in parentheses and may hold spaces and ")": split after it
    return int(stat_line[stat_line.rfind(")") + 2 :].split()[19])


def process_alive(pid: int | None, start_ticks: int | None) -> bool:
    """Whether `pid` still runs and is the process that had `start_ticks` (None: any start)."""
    if not pid:
        return False
    now = process_start_ticks(pid)
    return now is not None and (start_ticks is None or now == start_ticks)


class UnsafeDirError(PermissionError):
    """A runtime directory or file that another user could control; the message names it."""


def runtime_root() -> Path:
    """Where this user's runtime state goes (not created here: see `private_dir`). Root uses
    /run/slipstream (root-owned, world-searchable: the bwrap sandbox uid must reach its rootfs
    cache); other users their $XDG_RUNTIME_DIR when it is theirs, else ~/.cache/slipstream/run."""
    if os.geteuid() == 0:
        return Path("/run/slipstream")
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and os.path.isabs(xdg):
        try:
            st = os.lstat(xdg)
        except OSError:
            st = None
        if st is not None and _why_unsafe(st, os.geteuid()) is None:
            return Path(xdg) / "slipstream"
    return Path.home() / ".cache" / "slipstream" / "run"


def _why_unsafe(st: os.stat_result, euid: int) -> str | None:
    if stat.S_ISLNK(st.st_mode):
        return "is a symbolic link"
    if not stat.S_ISDIR(st.st_mode):
        return "is not a directory"
    if st.st_uid != euid:
        return f"is owned by uid {st.st_uid}, not by uid {euid} (this process)"
    if st.st_mode & 0o022:
        return f"is writable by group or others (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def _check_ancestors(path: Path, euid: int) -> None:
    """Every existing ancestor of `path` (symlinks resolved) must be owned by root or `euid`, and
    sticky if others may write to it: otherwise its owner could rename our directory away."""
    real = Path(os.path.realpath(path.parent))
    for anc in [real, *real.parents]:
        st = os.stat(anc)
        if st.st_uid not in (0, euid):
            raise UnsafeDirError(
                f"runtime directory {path}: its ancestor {anc} is owned by uid {st.st_uid}, "
                f"who could replace it; use a directory owned by uid {euid} or root"
            )
        if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
            raise UnsafeDirError(
                f"runtime directory {path}: its ancestor {anc} is writable by group or others "
                f"(mode {stat.S_IMODE(st.st_mode):04o}) and not sticky"
            )


def check_dir(path: str | Path) -> None:
    """UnsafeDirError naming `path` unless it is a private directory as described above."""
    path = Path(os.path.abspath(path))
    euid = os.geteuid()
    _check_ancestors(path, euid)
    why = _why_unsafe(os.lstat(path), euid)
    if why is not None:
        raise UnsafeDirError(f"runtime directory {path} {why}; refusing to use it")


def private_dir(path: str | Path, mode: int = 0o700) -> Path:
    """`path`, created (missing parents with 0o755, itself with `mode`) or, when it exists,
    checked: owner, mode, no symlink, safe ancestors. `mode` must not give write to others."""
    if mode & 0o022:
        raise ValueError(f"private_dir mode {mode:04o} gives write access to group or others")
    path = Path(os.path.abspath(path))
    missing = []
    p = path
    while not os.path.lexists(p):
        missing.append(p)
        p = p.parent
    for i, d in enumerate(reversed(missing)):
        d_mode = mode if i == len(missing) - 1 else 0o755
        try:
            os.mkdir(d, d_mode)
        except FileExistsError:
            continue  # made by a concurrent process: the check below decides whether it is ours
        os.chmod(d, d_mode)  # umask may have removed bits the sandbox uid needs (0o755 caches)
    check_dir(path)
    return path


def open_dir(path: str | Path) -> int:
    """A checked private directory's fd (O_NOFOLLOW: a symlink put there after the check is
    refused), verified again on the fd itself. Close it with os.close."""
    check_dir(path)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    why = _why_unsafe(os.fstat(fd), os.geteuid())
    if why is not None:
        os.close(fd)
        raise UnsafeDirError(f"runtime directory {path} {why}; refusing to use it")
    return fd


def read_at(dir_fd: int, name: str, max_bytes: int) -> bytes:
    """The contents of regular file `name` in `dir_fd`, if we own it and it is not a link (else
    UnsafeDirError); ValueError past `max_bytes`; FileNotFoundError when absent."""
    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=dir_fd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            raise UnsafeDirError(
                f"runtime file {name}: not a regular file owned by uid {os.geteuid()}"
            )
        if st.st_size > max_bytes:
            raise ValueError(f"runtime file {name}: {st.st_size} bytes > limit {max_bytes}")
        with os.fdopen(os.dup(fd), "rb") as f:
            return f.read(max_bytes)
    finally:
        os.close(fd)


def write_at(dir_fd: int, name: str, data: bytes, mode: int = 0o600) -> None:
    """Atomically replace `name` in `dir_fd` with `data` (a fresh temp file, O_EXCL|O_NOFOLLOW,
    then rename), so a reader never sees half a file and no link is ever written through."""
    tmp = f".{name}.{os.getpid()}.tmp"
    try:
        os.unlink(tmp, dir_fd=dir_fd)
    except FileNotFoundError:
        pass
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(tmp, flags, mode, dir_fd=dir_fd)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        try:
            os.unlink(tmp, dir_fd=dir_fd)
        except FileNotFoundError:
            pass
        raise


def create_once_at(dir_fd: int, name: str, data: bytes, mode: int = 0o600) -> bool:
    """Create `name` with `data` unless it exists (then leave it): a temp file hard-linked into
    place, so a concurrent reader sees the whole file or none. True when this call created it."""
    tmp = f".{name}.{os.getpid()}.tmp"
    write_at(dir_fd, tmp, data, mode)
    try:
        os.link(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd, follow_symlinks=False)
        return True
    except FileExistsError:
        return False
    finally:
        os.unlink(tmp, dir_fd=dir_fd)


def unlink_at(dir_fd: int, name: str) -> None:
    try:
        os.unlink(name, dir_fd=dir_fd)
    except FileNotFoundError:
        pass


def list_at(dir_fd: int) -> list[str]:
    return sorted(os.listdir(dir_fd))


__all__ = [
    "UnsafeDirError",
    "check_dir",
    "create_once_at",
    "list_at",
    "open_dir",
    "private_dir",
    "read_at",
    "runtime_root",
    "unlink_at",
    "write_at",
]
