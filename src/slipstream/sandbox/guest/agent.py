#!/usr/bin/env python3
"""slipstream guest agent: runs commands on behalf of the host inside a sandbox.

One stdlib-only program (Python >= 3.8, no third-party imports) used unchanged as the entry point of
bwrap/process sandboxes (channel = stdin/stdout) and inside microVMs (channel = a character device
such as /dev/vport0p1 or /dev/hvc0 via `--device PATH`, or AF_VSOCK via `--vsock PORT`).

Wire format (both directions): a frame is a 4-byte big-endian length followed by that many bytes of
UTF-8 JSON encoding one object with a "type" key. Requests carry an integer "id" that every reply
echoes. Binary payloads are base64 strings.

  agent -> host, once when ready:  {"type": "hello", "version", "pid", "uname", "python", "workdir"}
  exec      {argv, stdin_b64?, env?, cwd?, timeout_s?, output_cap_bytes?, files?: {relpath: b64}}
            -> zero or more {"type": "output", "stream": "stdout"|"stderr", "data": b64}
            -> {"type": "exit", exit_code, signal, timed_out, wall_s, cpu_s, max_rss_bytes,
                truncated, stdout_truncated, stderr_truncated}
  put_file  {path, data (b64), mode?}        -> {"type": "ok"}
  get_file  {path, max_bytes?}               -> {"type": "ok", "data": b64, "size"}
  reset     {}   kill strays, wipe workdir   -> {"type": "ok"}
  ping      {}                               -> {"type": "pong"}
  any failure of a request                   -> {"type": "error", "error": message}

Contract: requests are handled one at a time. `exec` runs the command in a new session (its own
process group); on timeout the whole group is SIGKILLed. After every command, processes that
outlived it are killed: its process group, and (the agent is a child subreaper when ctypes is
available) every orphaned descendant re-parented to the agent. The output cap applies per stream;
output past it is drained and dropped. Paths in put_file/get_file/files are relative to the work
directory and may not leave it (symlinks are resolved first), and they must name regular files:
a FIFO, device, socket or directory planted there by a command is refused with an error, without
blocking (files are opened O_NONBLOCK | O_NOFOLLOW and checked with fstat), so a command that
turns its results file into a FIFO cannot stall the agent. Not covered: resource limits (the host applies cgroups/rlimits),
concurrent execs, a command that escapes via setsid *and* is not our descendant (impossible in a
private PID namespace or a VM).
"""

import argparse
import base64
import errno
import json
import os
import selectors
import signal
import stat
import struct
import subprocess
import sys
import time

# platform, shutil and socket are imported where they are used (or not at all): the agent starts
# once per sandbox, before its hello, so its imports are part of every cold sandbox's creation;
# these three were ~9 ms of the agent's ~37 ms of imports on the dev VM (`python3 -I -S -X
# importtime agent.py`; json's re and enum are most of the rest).

AGENT_VERSION = "1"
MAX_FRAME_BYTES = 64 * 1024 * 1024
READ_CHUNK_BYTES = 64 * 1024
DEFAULT_OUTPUT_CAP_BYTES = 1024 * 1024
PR_SET_CHILD_SUBREAPER = 36
BASE_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "LANG": "C.UTF-8",
    "PYTHONDONTWRITEBYTECODE": "1",
    "PYTHONUNBUFFERED": "1",
}


class ProtocolError(Exception):
    """The peer sent something that is not a valid frame."""


# ---------------------------------------------------------------- framing


def _read_exact(fd, n):
    chunks = []
    while n:
        b = os.read(fd, n)
        if not b:
            return None
        chunks.append(b)
        n -= len(b)
    return b"".join(chunks)


def read_frame(fd):
    """Next frame as a dict, or None at end of stream."""
    header = _read_exact(fd, 4)
    if header is None:
        return None
    (length,) = struct.unpack(">I", header)
    if length > MAX_FRAME_BYTES:
        raise ProtocolError(f"frame of {length} bytes exceeds {MAX_FRAME_BYTES}")
    body = _read_exact(fd, length)
    if body is None:
        return None
    msg = json.loads(body.decode("utf-8"))
    if not isinstance(msg, dict):
        raise ProtocolError("frame is not a JSON object")
    return msg


def write_frame(fd, msg):
    body = json.dumps(msg, separators=(",", ":")).encode("utf-8")
    data = memoryview(struct.pack(">I", len(body)) + body)
    while data:
        n = os.write(fd, data)
        data = data[n:]


def _b64(data):
    return base64.b64encode(data).decode("ascii")


# ---------------------------------------------------------------- process hygiene


def become_subreaper():
    """Orphaned descendants re-parent to us, so stray daemons can be found and killed."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (ImportError, OSError, AttributeError):
        return False


def _children_of(pid):
    kids = []
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        pass
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2 :].split()
        if int(fields[1]) == pid:
            kids.append(int(name))
    return kids


def _reap_zombies():
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return False  # no children at all
        if pid == 0:
            return True  # live children remain


def kill_strays():
    """SIGKILL every descendant of the agent and reap it."""
    me = os.getpid()
    for _ in range(200):
        if not _reap_zombies():
            return
        kids = _children_of(me)
        if not kids:
            return
        for pid in kids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.002)


# ---------------------------------------------------------------- requests


class Agent:
    def __init__(self, rfd, wfd, workdir):
        self.rfd = rfd
        self.wfd = wfd
        self.workdir = os.path.realpath(workdir)
        os.makedirs(self.workdir, exist_ok=True)

    def send(self, msg):
        write_frame(self.wfd, msg)

    def hello(self):
        self.send(
            {
                "type": "hello",
                "version": AGENT_VERSION,
                "pid": os.getpid(),
                "uname": " ".join(os.uname()),
                "python": ".".join(str(v) for v in sys.version_info[:3]),
                "workdir": self.workdir,
            }
        )

    def resolve(self, rel):
        path = os.path.realpath(os.path.join(self.workdir, rel))
        if path != self.workdir and not path.startswith(self.workdir + os.sep):
            raise ValueError(f"path {rel!r} leaves the work directory")
        return path

    def warm_up(self):
        """Run one throwaway command before hello so that the first real exec does not pay for
        first-use costs (page faults of the first fork, pipe/selector setup) on the critical path."""

        class _Sink:
            def send(self, msg):
                pass

        try:
            Exec(_Sink(), 0, ["true"], dict(BASE_ENV), self.workdir, 5.0, 1024, b"").run()
        except OSError:
            pass  # no `true` in this image: nothing to warm up with

    def serve(self):
        self.warm_up()
        self.hello()
        while True:
            msg = read_frame(self.rfd)
            if msg is None:
                kill_strays()
                return
            rid = msg.get("id")
            kind = msg.get("type")
            handler = getattr(self, "do_" + str(kind), None)
            try:
                if handler is None:
                    raise ValueError(f"unknown request type {kind!r}")
                handler(rid, msg)
            except (OSError, ValueError, KeyError, TypeError, ProtocolError) as e:
                self.send({"type": "error", "id": rid, "error": f"{type(e).__name__}: {e}"})

    def do_ping(self, rid, msg):
        self.send({"type": "pong", "id": rid})

    def do_put_file(self, rid, msg):
        self._put(msg["path"], base64.b64decode(msg["data"]), msg.get("mode"))
        self.send({"type": "ok", "id": rid})

    def _put(self, rel, data, mode=None):
        path = self.resolve(rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd = _open_regular(rel, path, os.O_WRONLY | os.O_CREAT)
        try:
            os.ftruncate(fd, 0)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            if mode is not None:
                os.fchmod(fd, int(mode))
        finally:
            os.close(fd)

    def do_get_file(self, rid, msg):
        path = self.resolve(msg["path"])
        max_bytes = int(msg.get("max_bytes", MAX_FRAME_BYTES // 2))
        fd = _open_regular(msg["path"], path, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            if size > max_bytes:
                raise ValueError(f"{msg['path']} is {size} bytes, more than max_bytes={max_bytes}")
            chunks, left = [], max_bytes + 1  # a file that grows past the cap is refused too
            while left > 0:
                chunk = os.read(fd, min(left, READ_CHUNK_BYTES * 16))
                if not chunk:
                    break
                chunks.append(chunk)
                left -= len(chunk)
        finally:
            os.close(fd)
        data = b"".join(chunks)
        if len(data) > max_bytes:
            raise ValueError(f"{msg['path']} grew past max_bytes={max_bytes} while being read")
        self.send({"type": "ok", "id": rid, "data": _b64(data), "size": len(data)})

    def do_reset(self, rid, msg):
        import shutil  # here, not at the top: see the note on imports there

        kill_strays()
        for name in os.listdir(self.workdir):
            p = os.path.join(self.workdir, name)
            if os.path.isdir(p) and not os.path.islink(p):
                shutil.rmtree(p, ignore_errors=True)
            else:
                os.unlink(p)
        self.send({"type": "ok", "id": rid})

    def do_exec(self, rid, msg):
        for rel, data in (msg.get("files") or {}).items():
            self._put(rel, base64.b64decode(data))
        argv = [str(a) for a in msg["argv"]]
        if not argv:
            raise ValueError("exec with an empty argv")
        env = dict(BASE_ENV, HOME=self.workdir, TMPDIR=self.workdir)
        env.update({str(k): str(v) for k, v in (msg.get("env") or {}).items()})
        cwd = self.resolve(msg.get("cwd") or ".")
        timeout_s = float(msg.get("timeout_s") or 30.0)
        cap = int(msg.get("output_cap_bytes") or DEFAULT_OUTPUT_CAP_BYTES)
        stdin = base64.b64decode(msg["stdin_b64"]) if msg.get("stdin_b64") else b""
        Exec(self, rid, argv, env, cwd, timeout_s, cap, stdin).run()


class Exec:
    """One command: spawn in a new session, pump stdin/stdout/stderr, enforce the deadline."""

    def __init__(self, agent, rid, argv, env, cwd, timeout_s, cap, stdin):
        self.agent, self.rid, self.argv, self.env, self.cwd = agent, rid, argv, env, cwd
        self.timeout_s, self.cap, self.stdin = timeout_s, cap, stdin
        self.kept = {"stdout": 0, "stderr": 0}
        self.truncated = {"stdout": False, "stderr": False}

    def exit_frame(self, code, sig, timed_out, wall_s, cpu_s, rss):
        return {
            "type": "exit",
            "id": self.rid,
            "exit_code": code,
            "signal": sig,
            "timed_out": timed_out,
            "wall_s": wall_s,
            "cpu_s": cpu_s,
            "max_rss_bytes": rss,
            "truncated": self.truncated["stdout"] or self.truncated["stderr"],
            "stdout_truncated": self.truncated["stdout"],
            "stderr_truncated": self.truncated["stderr"],
        }

    def emit(self, stream, data):
        room = self.cap - self.kept[stream]
        if len(data) > room:
            self.truncated[stream] = True
            data = data[: max(room, 0)]
        if data:
            self.kept[stream] += len(data)
            self.agent.send(
                {"type": "output", "id": self.rid, "stream": stream, "data": _b64(data)}
            )

    def run(self):
        t0 = time.monotonic()
        sin_r, sin_w = os.pipe()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        try:
            pid = self.spawn(sin_r, out_w, err_w)
        except OSError as e:
            for fd in (sin_r, sin_w, out_r, out_w, err_r, err_w):
                os.close(fd)
            self.emit("stderr", (f"slipstream-agent: cannot exec {self.argv[0]!r}: {e}\n").encode())
            code = 127 if isinstance(e, FileNotFoundError) else 126
            self.agent.send(self.exit_frame(code, None, False, time.monotonic() - t0, 0.0, 0))
            return
        for fd in (sin_r, out_w, err_w):
            os.close(fd)
        try:
            with open(f"/proc/{pid}/oom_score_adj", "w") as f:
                f.write("1000")  # under memory pressure the command dies, not the agent
        except OSError:
            pass
        timed_out, status, rusage = self.pump(pid, t0, sin_w, out_r, err_r)
        wall_s = time.monotonic() - t0
        kill_strays()
        code, sig = None, None
        if os.WIFEXITED(status):
            code = os.WEXITSTATUS(status)
        elif os.WIFSIGNALED(status):
            sig = os.WTERMSIG(status)
            code = -sig
        cpu_s = rusage.ru_utime + rusage.ru_stime
        rss = int(rusage.ru_maxrss) * 1024
        self.agent.send(self.exit_frame(code, sig, timed_out, wall_s, cpu_s, rss))

    def spawn(self, sin_r, out_w, err_w):
        proc = subprocess.Popen(
            self.argv,
            stdin=sin_r,
            stdout=out_w,
            stderr=err_w,
            cwd=self.cwd,
            env=self.env,
            start_new_session=True,  # own process group: one killpg ends the command's tree
        )
        proc.returncode = 0  # reaped by os.wait4 below; keeps Popen.__del__ quiet
        return proc.pid

    def pump(self, pid, t0, sin_w, out_r, err_r):
        sel = selectors.DefaultSelector()
        names = {out_r: "stdout", err_r: "stderr"}
        for fd in names:
            sel.register(fd, selectors.EVENT_READ)
        stdin = memoryview(self.stdin)
        if stdin:
            os.set_blocking(sin_w, False)
            sel.register(sin_w, selectors.EVENT_WRITE)
        else:
            os.close(sin_w)
        pidfd = None
        if hasattr(os, "pidfd_open"):
            try:
                pidfd = os.pidfd_open(pid)
                sel.register(pidfd, selectors.EVENT_READ)
            except OSError:
                pidfd = None
        deadline = t0 + self.timeout_s
        timed_out = False
        result = None
        drain_until = None  # after the command exits, a short grace for buffered output
        while True:
            now = time.monotonic()
            if result is None and now >= deadline:
                timed_out = True
                _killpg(pid)
            if drain_until is not None and now >= drain_until:
                break
            if not any(k.fd in names for k in sel.get_map().values()) and result is not None:
                break
            if result is None:
                result = _try_wait(pid)
                if result is not None:
                    _killpg(pid)
                    drain_until = time.monotonic() + 0.5
            wait_s = max(0.0, deadline - now) if result is None else 0.05
            if pidfd is None and result is None:
                wait_s = min(wait_s, 0.01)
            for key, _ in sel.select(timeout=wait_s):
                fd = key.fd
                if fd == pidfd:
                    sel.unregister(fd)
                    os.close(fd)
                    pidfd = None
                    continue
                if fd == sin_w:
                    try:
                        n = os.write(fd, stdin[:READ_CHUNK_BYTES])
                    except BlockingIOError:
                        n = 0
                    except BrokenPipeError:
                        n = len(stdin)  # the command closed its stdin: drop the rest
                    stdin = stdin[n:]
                    if not stdin:
                        sel.unregister(fd)
                        os.close(fd)
                    continue
                data = os.read(fd, READ_CHUNK_BYTES)
                if not data:
                    sel.unregister(fd)
                    os.close(fd)
                    continue
                self.emit(names[fd], data)
            if result is None and not any(k.fd in names for k in sel.get_map().values()):
                # both pipes closed: the command is (nearly) done; wait for it within the deadline
                while result is None and time.monotonic() < deadline:
                    result = _try_wait(pid)
                    if result is None:
                        time.sleep(0.0005)
                if result is None:
                    timed_out = True
                    _killpg(pid)
                    result = os.wait4(pid, 0)[1:]
                break
        for key in list(sel.get_map().values()):
            sel.unregister(key.fd)
            os.close(key.fd)
        sel.close()
        if result is None:
            _killpg(pid)
            result = os.wait4(pid, 0)[1:]
        return timed_out, result[0], result[1]


_KINDS = (
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISLNK, "a symlink"),
)


def _kind(mode):
    for test, name in _KINDS:
        if test(mode):
            return name
    return "not a regular file"


def _open_regular(rel, path, flags):
    """An fd of the regular file at `path` (created when flags has O_CREAT). Anything else is
    refused with ValueError before any blocking call: lstat first (a FIFO, device or socket),
    then open with O_NONBLOCK | O_NOFOLLOW (a FIFO swapped in meanwhile opens without waiting
    for a peer; a symlink fails) and fstat again; the fd is made blocking only for a regular
    file, where blocking never waits on another process."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        if not flags & os.O_CREAT:
            raise
    else:
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{rel} is {_kind(st.st_mode)}, not a regular file")
    try:
        fd = os.open(path, flags | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENXIO):  # a symlink / a FIFO or socket without peer
            raise ValueError(f"{rel} is not a regular file ({os.strerror(e.errno)})") from None
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise ValueError(f"{rel} is {_kind(st.st_mode)}, not a regular file")
    os.set_blocking(fd, True)
    return fd


def _try_wait(pid):
    wpid, status, rusage = os.wait4(pid, os.WNOHANG)
    return None if wpid == 0 else (status, rusage)


def _killpg(pid):
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


# ---------------------------------------------------------------- channels


def _open_channel(args):
    """(read fd, write fd) of the control channel."""
    if args.device:
        fd = os.open(args.device, os.O_RDWR | os.O_NOCTTY)
        if os.isatty(fd):
            try:
                import tty

                tty.setraw(fd)
            except ImportError:
                pass
        return fd, fd
    # stdio: keep private copies and point fds 0/1 away so nothing else can corrupt the channel
    rfd, wfd = os.dup(0), os.dup(1)
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(2, 1)
    os.close(devnull)
    return rfd, wfd


def _serve_vsock(port, workdir):
    import socket  # here, not at the top: see the note on imports there

    srv = socket.socket(socket.AF_VSOCK, socket.SOCK_STREAM)
    srv.bind((socket.VMADDR_CID_ANY, port))
    srv.listen(1)
    while True:  # one host connection at a time; a new one after the previous closes
        conn, _ = srv.accept()
        try:
            Agent(conn.fileno(), conn.fileno(), workdir).serve()
        except (OSError, ProtocolError) as e:
            sys.stderr.write(f"slipstream-agent: vsock session ended: {e}\n")
        finally:
            conn.close()


def main(argv=None):
    p = argparse.ArgumentParser(description="slipstream guest agent (length-prefixed JSON frames)")
    p.add_argument("--device", help="character device for the channel (default: stdin/stdout)")
    p.add_argument("--vsock", type=int, metavar="PORT", help="listen on AF_VSOCK PORT instead")
    p.add_argument("--workdir", default=os.environ.get("SLIPSTREAM_WORKDIR", "/sandbox"))
    args = p.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    become_subreaper()
    if args.vsock is not None:
        _serve_vsock(args.vsock, args.workdir)
        return 0
    rfd, wfd = _open_channel(args)
    try:
        Agent(rfd, wfd, args.workdir).serve()
    finally:
        kill_strays()
    return 0


if __name__ == "__main__":
    sys.exit(main())
