"""The host agent's local resources: its state-dir lock, its Unix socket, the peer's credentials.

- `take_state_lock(state_dir)`: an flock on `<state_dir>/agent.lock` (holding the agent's pid);
  a second agent on the same state dir is refused, naming the holder. The lock goes with the
  process (a SIGKILLed agent's lock is free at once).
- `check_socket_free(path)`: refuses a path that is not a socket, or a socket another process
  still accepts on; a stale socket (connection refused) is left for `bind_socket` to replace.
- `bind_socket(path, mode, gid)`: binds under a temporary name with owner-only permissions,
  sets the group and mode, then renames it into place, so the final path never exists with
  looser permissions than asked.

Not covered: sockets on filesystems without Unix socket support, abstract sockets.
"""

from __future__ import annotations

import fcntl
import os
import socket
import stat
import struct
from pathlib import Path

from slipstream.sandbox.errors import SandboxError


def take_state_lock(state_dir: Path) -> int:
    """The lock's fd (close it to release); SandboxError naming the holder when taken."""
    path = state_dir / "agent.lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise SandboxError(
            f"another host agent (pid {holder}) holds {path}: one agent per state dir"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def check_socket_free(path: Path) -> None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise SandboxError(f"host agent: {path} exists and is not a socket; not replacing it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(2.0)
        probe.connect(str(path))
    except (ConnectionRefusedError, FileNotFoundError):
        return  # stale: a crashed agent's; bind_socket's rename replaces it
    except OSError as e:
        raise SandboxError(f"host agent: cannot probe existing socket {path}: {e}") from None
    finally:
        probe.close()
    raise SandboxError(f"host agent: another agent is serving {path}")


def bind_socket(path: Path, mode: int, gid: int | None) -> socket.socket:
    """A listening socket at `path` with `mode` (and group `gid`, when given)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.{os.getpid()}.tmp"
    tmp.unlink(missing_ok=True)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_umask = os.umask(0o177)
    try:
        sock.bind(str(tmp))
    finally:
        os.umask(old_umask)
    try:
        if gid is not None:
            os.chown(tmp, -1, gid)
        os.chmod(tmp, mode)
        sock.listen(128)
        os.replace(tmp, path)
    except OSError:
        sock.close()
        tmp.unlink(missing_ok=True)
        raise
    return sock


def unlink_socket(path: Path, inode: int | None) -> None:
    """Remove the socket at `path` if it is still the one we bound (same inode)."""
    try:
        if inode is not None and os.lstat(path).st_ino == inode:
            path.unlink()
    except FileNotFoundError:
        pass


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the connected peer (SO_PEERCRED); pid 0 when not in our pid namespace."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    return pid, uid, gid
