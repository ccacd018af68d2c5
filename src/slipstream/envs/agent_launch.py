"""How an agent run's process is started (envs/agent.py does everything around it: the work
directory, the files, the wall-clock bound, killing the process group, reading the output).

    launcher = make_launcher(cfg, cwd)        # once per AgentRuntime; launcher.close() at the end
    proc = launcher.start(stdin=f0, stdout=f1, stderr=f2, cwd=work, env=episode_env)
    proc.pid        # leads its own session: os.killpg(proc.pid, ...) reaches all it started
    proc.wait(timeout=0.05)   # its exit code; subprocess.TimeoutExpired while it runs
    confinement = launcher.finish(proc)   # after its group is killed: what its cgroup saw

Two ways, one `Launcher` protocol:
- `PopenLauncher` (`agent.preload` empty): `/bin/sh -c "ulimit ...; COMMAND"` in a new session,
  one fresh interpreter per episode (the agent's imports paid every time).
- `ForkLauncher` (`agent.preload = ["openai", ...]`): a template process, started once with a
  clean spawn (`python -c`, an environment of PATH, LANG, HOME and `agent.env` only), imports
  the preload modules and waits on a Unix socket. Per run the parent sends the episode's argv,
  environment and cwd with the stdin/stdout/stderr descriptors (SCM_RIGHTS) and a reply socket;
  the template forks a child that starts a new session, takes the descriptors as 0/1/2, closes
  every other descriptor, sets the rlimits, cwd, `os.environ` (cleared, then exactly the
  episode's), `sys.argv`, `sys.path[0]`, and runs the script (`runpy.run_path(script,
  run_name="__main__")`, or `run_module` for `-m`) and exits with its code (SystemExit as
  Python does; an uncaught exception's traceback on its stderr, exit 1). The template reaps it
  (a pidfd per child) and sends its exit code on the reply socket; the parent's process object
  sees a pid, an exit code and `subprocess.TimeoutExpired` just as with Popen. A template that
  died is started again (logged) on the next run; runs in flight when it dies end with exit
  code `TEMPLATE_LOST` (their process groups killed by the parent as ever).
- `SandboxLauncher` (`agent.sandbox = true`): the same `/bin/sh -c` inside a bwrap sandbox
  (sandbox/bwrap.py's namespaces, read-only system dirs, minimal /etc and seccomp filter) that
  sees the Python installation and `agent.sandbox_binds` read-only, the run's work directory
  at /sandbox (writable), a private /tmp, and no network but its own loopback. Its first
  process is envs/agent_forward.py: it listens on 127.0.0.1:`SANDBOX_PORT` there, starts the
  agent, and forwards each connection to the episode's Unix socket (`endpoint_socket`, served
  by the endpoint for that episode alone), bind-mounted at `SANDBOX_SOCKET`. The process the
  runtime holds is bwrap's, the leader of a new session: killing its group kills the sandbox
  (`--die-with-parent`; the pid namespace ends with its first process). With
  `agent.sandbox_cgroup` (the default) each run also gets a cgroup of its own
  (sandbox/cgroups.py, as the `bwrap` backend's sandboxes: memory + swap, pids, CPU quota),
  entered by bwrap's exec chain before bwrap runs (`/bin/sh` writes its pid into the
  cgroup.procs files, then execs bwrap: the same pid, so nothing of the sandbox runs outside;
  no Python `preexec_fn`, which would make Popen fork the whole worker). `finish` reads its OOM
  kills and pids-limit hits, kills what is left in it and removes it.

The template's module is this file, run by path (`runpy.run_path`): everything the template
executes is standard library, so neither slipstream nor torch is imported there.
"""

from __future__ import annotations

import errno
import itertools
import json
import logging
import os
import resource
import select
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, NoReturn, Protocol

if TYPE_CHECKING:
    from slipstream.config.agent import AgentConfig
    from slipstream.sandbox.cgroups import Cgroup

log = logging.getLogger(__name__)

TEMPLATE_START_TIMEOUT_S = 300.0
"""Longest wait for the template's imports (a cold disk, a loaded host)."""
TEMPLATE_LOST = -1000
"""Exit code of a forked run whose template died before reporting it (never a real code:
those are 0..255 or -signal)."""
MAX_MESSAGE_BYTES = 1 << 20
"""Largest request (argv + environment as JSON) or reply on the template's sockets."""
SANDBOX_WORKDIR = "/sandbox"
"""A sandboxed run's work directory (and HOME) as the agent sees it."""
SANDBOX_PORT = 8000
"""The forwarder's port on the sandbox's own loopback (nothing else listens there)."""
SANDBOX_BASE_URL = f"http://127.0.0.1:{SANDBOX_PORT}/v1"
"""`OPENAI_BASE_URL` inside the sandbox: the episode's endpoint, through the forwarder."""
SANDBOX_SOCKET_DIR = "/run/slipstream"
"""Where the directory of the episode's endpoint socket is bound (read-only)."""
FORWARDER_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "agent_forward.py")
FORWARDER_IN_SANDBOX = "/opt/slipstream/agent_forward.py"
CGROUP_ROOT = "/sys/fs/cgroup"
"""Where sandboxed runs' cgroups are made (sandbox/cgroups.py `CgroupManager.detect`)."""


@dataclass(frozen=True)
class Confinement:
    """What a run's cgroup saw (all zero / None for a run without one)."""

    oom_kills: int = 0
    """Processes of the run the kernel OOM-killed at `agent.sandbox_memory_mib`."""
    pids_max_hits: int = 0
    """Forks and thread starts refused at `agent.sandbox_pids_max`."""
    peak_memory_bytes: int | None = None


class AgentProcess(Protocol):
    """A started agent: `subprocess.Popen` is one."""

    @property
    def pid(self) -> int: ...

    @property
    def returncode(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int:
        """Its exit code (-N: killed by signal N); `subprocess.TimeoutExpired` past `timeout`."""
        ...


class Launcher(Protocol):
    def start(self, *, stdin: IO[bytes], stdout: IO[bytes], stderr: IO[bytes], cwd: str,
              env: dict[str, str], endpoint_socket: str | None = None) -> AgentProcess:  # fmt: skip
        """Start one run of the agent as the leader of a new session (`endpoint_socket`: the
        episode endpoint's Unix socket, which a sandboxed run needs; it then sees its work
        directory at `SANDBOX_WORKDIR` and its endpoint at `SANDBOX_BASE_URL`)."""
        ...

    def finish(self, proc: AgentProcess) -> Confinement:
        """After the run's process group was killed and reaped: release what the launcher holds
        for it (a sandboxed run's cgroup: what is left in it killed, the cgroup removed) and
        report what its limits saw. Called once per started run."""
        ...

    def close(self) -> None: ...


def make_launcher(cfg: AgentConfig, cwd: str) -> Launcher:
    """`SandboxLauncher` with `cfg.sandbox`, `ForkLauncher` when `cfg.preload` names modules,
    else `PopenLauncher`. `cwd` replaces `{cwd}` in the command."""
    if cfg.sandbox:
        return SandboxLauncher(cfg, cwd)
    if cfg.preload:
        return ForkLauncher(cfg, cwd)
    return PopenLauncher(cfg, cwd)


def _limits(cfg: AgentConfig) -> tuple[int, int]:
    """(address space bytes, file size bytes): `agent.memory_mib`, `agent.max_output_bytes`
    rounded down to sh's 512-byte `ulimit -f` blocks (both ways agree)."""
    return cfg.memory_mib << 20, max(1, cfg.max_output_bytes // 512) * 512


def _fill(text: str, cwd: str) -> str:
    return text.replace("{python}", sys.executable).replace("{cwd}", cwd)


class PopenLauncher:
    """One `/bin/sh -c` per run (the command as written, shell syntax and all)."""

    def __init__(self, cfg: AgentConfig, cwd: str) -> None:
        as_bytes, fsize_bytes = _limits(cfg)
        self.argv = [
            "/bin/sh",
            "-c",
            f"ulimit -v {as_bytes >> 10} && ulimit -f {fsize_bytes // 512} && ulimit -c 0 "
            f"|| exit 126\n{_fill(cfg.command, cwd)}",
        ]

    def start(self, *, stdin: IO[bytes], stdout: IO[bytes], stderr: IO[bytes], cwd: str,
              env: dict[str, str], endpoint_socket: str | None = None,
              ) -> subprocess.Popen[bytes]:  # fmt: skip
        return subprocess.Popen(self.argv, stdin=stdin, stdout=stdout, stderr=stderr, cwd=cwd,
                                env=env, start_new_session=True)  # fmt: skip

    def finish(self, proc: AgentProcess) -> Confinement:
        return Confinement()

    def close(self) -> None:
        pass


class ForkedProcess:
    """A run forked by the template: its pid (a session leader) and, on the reply socket, its
    exit code once the template reaped it. Should the template die first, the run goes on,
    orphaned: a pidfd (opened when the pid arrived, before the template could reap it) tells
    when it ends, and its code is `TEMPLATE_LOST`."""

    def __init__(self, pid: int, reply: socket.socket) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._reply: socket.socket | None = reply
        try:
            self._pidfd: int | None = os.pidfd_open(pid)
        except ProcessLookupError:  # it ended and was reaped already: its code is on the way
            self._pidfd = None
        self._lock = threading.Lock()

    def wait(self, timeout: float | None = None) -> int:
        with self._lock:
            if self.returncode is None:
                self.returncode = self._wait(timeout)
                if self._pidfd is not None:
                    os.close(self._pidfd)
                    self._pidfd = None
            return self.returncode

    def _wait(self, timeout: float | None) -> int:
        if self._reply is not None:
            self._reply.settimeout(timeout)
            try:
                msg = self._reply.recv(64)
            except TimeoutError:
                raise subprocess.TimeoutExpired(["agent", str(self.pid)], timeout or 0.0) from None
            except OSError:
                msg = b""
            self._reply.close()
            self._reply = None
            if msg.startswith(b"X"):
                return int(msg[1:])
            log.error("agent template died before reporting run %d's exit; it runs on, its exit "
                      "code lost", self.pid)  # fmt: skip
        if self._pidfd is not None:  # the orphan's end
            ready, _, _ = select.select([self._pidfd], [], [], timeout)
            if not ready:
                raise subprocess.TimeoutExpired(["agent", str(self.pid)], timeout or 0.0)
        return TEMPLATE_LOST


class ForkLauncher:
    """Runs forked from a warm template that imported `agent.preload` once (module docstring)."""

    def __init__(self, cfg: AgentConfig, cwd: str) -> None:
        from slipstream.config.agent import python_command

        cmd = python_command(cfg.command)  # the config validated it
        as_bytes, fsize_bytes = _limits(cfg)
        self._request: dict[str, Any] = {
            "script": None if cmd.script is None else _fill(cmd.script, cwd),
            "module": cmd.module,
            "args": [_fill(a, cwd) for a in cmd.args],
            "rlimits": {"as": as_bytes, "fsize": fsize_bytes},
        }
        self.preload = list(cfg.preload)
        self._extra_env = dict(cfg.env)
        self._lock = threading.Lock()
        self._closed = False
        self._home = tempfile.mkdtemp(prefix="slipstream-agent-template-")
        self._proc: subprocess.Popen[bytes] | None = None
        self._ctl: socket.socket | None = None
        try:
            self._spawn()
        except BaseException:
            self.close()
            raise

    @property
    def template_pid(self) -> int:
        assert self._proc is not None
        return self._proc.pid

    def _spawn(self) -> None:
        """Start the template and wait for its imports: ValueError naming the module that did
        not import, or the template's exit."""
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        boot = (
            "import runpy, sys; sys.path.pop(0); "  # `python -c` put '' there; a script has its dir
            f"runpy.run_path({__file__!r}, run_name='slipstream_agent_template')"
            "['_serve'](int(sys.argv[1]), sys.argv[2:])"
        )
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8",
               "HOME": self._home, **self._extra_env}  # fmt: skip
        try:
            proc = subprocess.Popen(
                [sys.executable, "-c", boot, str(child.fileno()), *self.preload],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, env=env, cwd=self._home,
                pass_fds=[child.fileno()], start_new_session=True,
            )  # fmt: skip
        finally:
            child.close()
        parent.settimeout(TEMPLATE_START_TIMEOUT_S)
        try:
            msg = parent.recv(MAX_MESSAGE_BYTES)
        except TimeoutError:
            msg = b"Fno answer after %d s" % TEMPLATE_START_TIMEOUT_S
        if msg != b"R":
            parent.close()
            _end(proc)
            why = msg[1:].decode(errors="replace") if msg else f"exit {proc.returncode}"
            raise ValueError(f"agent.preload {self.preload}: the agent template process did not "
                             f"start: {why}")  # fmt: skip
        parent.settimeout(None)
        self._proc, self._ctl = proc, parent

    def start(self, *, stdin: IO[bytes], stdout: IO[bytes], stderr: IO[bytes], cwd: str,
              env: dict[str, str], endpoint_socket: str | None = None,
              ) -> ForkedProcess:  # fmt: skip
        body = json.dumps({**self._request, "cwd": cwd, "env": env}).encode()
        if len(body) > MAX_MESSAGE_BYTES:
            raise ValueError(f"agent run request of {len(body)} bytes (agent.env too large?)")
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            fds = [stdin.fileno(), stdout.fileno(), stderr.fileno(), theirs.fileno()]
            with self._lock:
                if self._closed:
                    raise RuntimeError("the agent launcher is closed")
                for attempt in (0, 1):
                    assert self._proc is not None and self._ctl is not None
                    if self._proc.poll() is None:
                        try:
                            socket.send_fds(self._ctl, [body], fds)
                            break
                        except OSError as e:  # the template died since the check
                            if attempt or e.errno not in (errno.EPIPE, errno.ECONNRESET):
                                raise
                    self._restart()
        finally:
            theirs.close()  # the template holds its copy: EOF here means it died
        msg = mine.recv(MAX_MESSAGE_BYTES)
        if not msg.startswith(b"P"):
            # imported here, not at the top: the template runs this file outside slipstream
            from slipstream.envs.base import InfraError

            mine.close()
            why = msg[1:].decode(errors="replace") if msg else "the template died"
            raise InfraError(f"the agent template could not start the run: {why}")
        return ForkedProcess(int(msg[1:]), mine)

    def finish(self, proc: AgentProcess) -> Confinement:
        return Confinement()

    def _restart(self) -> None:
        assert self._proc is not None and self._ctl is not None
        self._ctl.close()
        _end(self._proc)
        log.warning("agent template process %d died (exit %s); starting a new one",
                    self._proc.pid, self._proc.returncode)  # fmt: skip
        self._spawn()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            if self._ctl is not None:
                self._ctl.close()  # the template exits at EOF; the kill makes sure
            if self._proc is not None:
                _end(self._proc)
            shutil.rmtree(self._home, ignore_errors=True)


class SandboxLauncher:
    """One `/bin/sh -c` per run inside a bwrap sandbox with no network but its episode's
    endpoint, each in a cgroup of its own with `agent.sandbox_cgroup` (module docstring;
    docs/agents.md, "Sandbox"). Built once per runtime: it stages the sandbox's /etc, checks
    the agent's script is reachable and the cgroups writable, and starts one sandbox (in a
    cgroup, as a run) to see that bwrap works here (ValueError naming `agent.sandbox` or
    `agent.sandbox_cgroup` when it does not)."""

    def __init__(self, cfg: AgentConfig, cwd: str) -> None:
        from slipstream.sandbox.bwrap import isolation_args, stage_etc
        from slipstream.sandbox.cgroups import CgroupLimits, CgroupManager
        from slipstream.sandbox.seccomp import build_filter

        self.bwrap = shutil.which("bwrap") or "/usr/bin/bwrap"
        if not os.access(self.bwrap, os.X_OK):
            raise ValueError("agent.sandbox = true needs bwrap (bubblewrap), which is not "
                             "installed (no bwrap on PATH or at /usr/bin/bwrap)")  # fmt: skip
        try:
            self._seccomp = build_filter()
        except NotImplementedError as e:
            raise ValueError(f"agent.sandbox = true: {e}") from None
        binds = [_fill(b, cwd) for b in cfg.sandbox_binds]
        for b in binds:
            if not os.path.exists(b):
                raise ValueError(f"agent.sandbox_binds: {b} does not exist")
        readable = _interpreter_dirs() + [os.path.realpath(b) for b in binds]
        _check_script(cfg.command, cwd, readable)
        self._cgroups: CgroupManager | None = None
        if cfg.sandbox_cgroup:
            try:
                self._cgroups = CgroupManager.detect(CGROUP_ROOT)
            except OSError as e:
                raise ValueError(_no_cgroups(e)) from None
        self._cgroup_limits = CgroupLimits(memory_bytes=cfg.sandbox_memory_mib << 20,
                                           pids_max=cfg.sandbox_pids_max, vcpus=cfg.sandbox_vcpus)  # fmt: skip
        # agent-<worker pid>-<n>: unique on the host while this worker runs
        self._cgroup_names = (f"agent-{os.getpid()}-{n}" for n in itertools.count())
        self._runs: dict[int, Cgroup] = {}  # pid of a run's bwrap -> its cgroup, until finish
        self._runs_lock = threading.Lock()
        if self._cgroups is not None:
            self._reap_orphans()
        self._dir = tempfile.mkdtemp(prefix="slipstream-agent-sandbox-")
        try:
            # the private /tmp first: a bind below /tmp (a job under /tmp) lands on top of it
            args = [self.bwrap, *isolation_args(stage_etc(Path(self._dir))),
                    "--size", str(cfg.sandbox_tmp_mib << 20), "--tmpfs", "/tmp",
                    # bwrap's /dev/shm is on its unbounded /dev tmpfs: bound it like /tmp
                    "--size", str(cfg.sandbox_tmp_mib << 20), "--tmpfs", "/dev/shm"]  # fmt: skip
            for host in _interpreter_dirs(names=True) + binds:
                args += ["--ro-bind", os.path.realpath(host), host]
            self._args = args
            self._agent_argv = PopenLauncher(cfg, cwd).argv
            self._probe()
        except BaseException:
            shutil.rmtree(self._dir, ignore_errors=True)
            raise

    def argv(self, work: str, endpoint_socket: str, seccomp_fd: int,
             command: list[str]) -> list[str]:  # fmt: skip
        """bwrap's argv for one run: `work` at SANDBOX_WORKDIR (writable), the directory of
        `endpoint_socket` at SANDBOX_SOCKET_DIR (read-only: the socket connects, nothing else
        is created there), the forwarder's file; then `command`."""
        return [
            *self._args,
            "--bind", work, SANDBOX_WORKDIR,
            "--ro-bind", os.path.dirname(endpoint_socket), SANDBOX_SOCKET_DIR,
            "--ro-bind", FORWARDER_SOURCE, FORWARDER_IN_SANDBOX,
            "--remount-ro", "/",
            "--chdir", SANDBOX_WORKDIR,
            "--seccomp", str(seccomp_fd),
            "--",
            *command,
        ]  # fmt: skip

    def _forwarded(self, endpoint_socket: str) -> list[str]:
        inside = f"{SANDBOX_SOCKET_DIR}/{os.path.basename(endpoint_socket)}"
        return [sys.executable, "-I", "-S", FORWARDER_IN_SANDBOX, str(SANDBOX_PORT), inside,
                *self._agent_argv]  # fmt: skip

    def _cgroup(self) -> Cgroup | None:
        """A new cgroup for one run (None without `agent.sandbox_cgroup`); OSError naming the
        file the kernel refused."""
        if self._cgroups is None:
            return None
        return self._cgroups.create(next(self._cgroup_names), self._cgroup_limits)

    def _reap_orphans(self) -> None:
        """Remove the cgroups of runs whose worker died before removing them (named
        agent-<pid>-<n>, that pid no longer running); what is still in them is killed."""
        assert self._cgroups is not None
        from slipstream.sandbox.cgroups import remove_cgroup_dirs

        for d in self._cgroups.leftover_dirs():
            parts = os.path.basename(d).split("-")
            if len(parts) != 3 or parts[0] != "agent" or not parts[1].isdigit():
                continue
            if int(parts[1]) == os.getpid() or os.path.exists(f"/proc/{parts[1]}"):
                continue
            log.warning("removing the cgroup %s of an agent run whose worker is gone", d)
            try:
                remove_cgroup_dirs([d])
            except OSError as e:
                log.error("%s", e)

    def _entered(self, cgroup: Cgroup | None, argv: list[str]) -> list[str]:
        """`argv` started inside `cgroup`: the exec chain of sandbox/bwrap.py writes the pid
        into each cgroup.procs file, then execs argv (exit 125 when a write fails)."""
        from slipstream.sandbox.bwrap import ENTER_CGROUP_SH, SH

        if cgroup is None:
            return argv
        return [SH, "-c", ENTER_CGROUP_SH, "sh", *cgroup.procs_files(), "--", *argv]

    def _probe(self) -> None:
        """Start one sandbox as a run would (in a cgroup of its own with `sandbox_cgroup`),
        with the interpreter's `pass` for the forwarder and the agent; a one-line ValueError
        naming `agent.sandbox` (with bwrap's own complaint) when it fails."""
        from slipstream.sandbox.seccomp import filter_fd

        try:
            cgroup = self._cgroup()
        except OSError as e:
            raise ValueError(_no_cgroups(e)) from None
        with tempfile.TemporaryDirectory(prefix="probe-", dir=self._dir) as d:
            for sub in ("work", "endpoint"):
                os.mkdir(os.path.join(d, sub))
            fd = filter_fd(self._seccomp)
            try:
                argv = self.argv(os.path.join(d, "work"), os.path.join(d, "endpoint", "sock"),
                                 fd, [sys.executable, "-I", "-S", "-c", "pass"])  # fmt: skip
                r = subprocess.run(self._entered(cgroup, argv), capture_output=True,
                                   pass_fds=(fd,), env={}, timeout=TEMPLATE_START_TIMEOUT_S,
                                   check=False)  # fmt: skip
            except subprocess.TimeoutExpired:
                raise ValueError(f"agent.sandbox = true: bwrap's probe sandbox did not end "
                                 f"within {TEMPLATE_START_TIMEOUT_S:g} s") from None  # fmt: skip
            finally:
                os.close(fd)
                if cgroup is not None:
                    cgroup.kill_and_remove()
        if r.returncode != 0:
            why = (r.stderr.decode(errors="replace").strip().splitlines() or [""])[-1]
            raise ValueError(f"agent.sandbox = true: bwrap cannot start a sandbox here (exit "
                             f"{r.returncode}: {why[:300]})")  # fmt: skip

    def start(self, *, stdin: IO[bytes], stdout: IO[bytes], stderr: IO[bytes], cwd: str,
              env: dict[str, str], endpoint_socket: str | None = None,
              ) -> subprocess.Popen[bytes]:  # fmt: skip
        from slipstream.sandbox.seccomp import filter_fd

        if endpoint_socket is None:
            raise ValueError("a sandboxed agent run needs its episode's endpoint socket")
        try:
            cgroup = self._cgroup()
        except OSError as e:
            from slipstream.envs.base import InfraError  # not at the top, as in ForkLauncher

            raise InfraError(f"agent.sandbox_cgroup: the run's cgroup: {_why(e)}") from None
        fd = filter_fd(self._seccomp)
        try:
            argv = self.argv(cwd, endpoint_socket, fd, self._forwarded(endpoint_socket))
            proc = subprocess.Popen(
                self._entered(cgroup, argv), stdin=stdin, stdout=stdout, stderr=stderr, cwd=cwd,
                env=env, pass_fds=(fd,), start_new_session=True,
            )  # fmt: skip
        except BaseException:
            if cgroup is not None:
                cgroup.kill_and_remove()
            raise
        finally:
            os.close(fd)
        if cgroup is not None:
            with self._runs_lock:
                self._runs[proc.pid] = cgroup
        return proc

    def finish(self, proc: AgentProcess) -> Confinement:
        """Read the run's cgroup (OOM kills, pids-limit hits, peak memory), then kill whatever
        is still in it (a process that left bwrap's group) and remove it."""
        with self._runs_lock:
            cgroup = self._runs.pop(proc.pid, None)
        if cgroup is None:
            return Confinement()
        try:
            return Confinement(oom_kills=cgroup.oom_kills(),
                               pids_max_hits=cgroup.pids_max_hits(),
                               peak_memory_bytes=cgroup.peak_memory_bytes())  # fmt: skip
        finally:
            try:
                cgroup.kill_and_remove()
            except OSError as e:  # the episode's result stands; the leak is logged
                log.error("agent run %d: its cgroup was not removed: %s", proc.pid, e)

    def close(self) -> None:
        with self._runs_lock:
            left = list(self._runs.values())
            self._runs.clear()
        for cgroup in left:  # runs never finished (the runtime closed under them)
            try:
                cgroup.kill_and_remove()
            except OSError as e:
                log.error("an agent run's cgroup was not removed: %s", e)
        shutil.rmtree(self._dir, ignore_errors=True)


def _no_cgroups(e: OSError) -> str:
    """The one-line error of a runtime whose runs' cgroups cannot be made here."""
    return (f"agent.sandbox_cgroup = true needs writable cgroups ({_why(e)}); run the job as "
            "root, or set agent.sandbox_cgroup = false to run sandboxed agents with ulimits only")  # fmt: skip


def _why(e: OSError) -> str:
    """An OSError as one phrase: its message and the path it names, no "[Errno N]"."""
    text = e.strerror or str(e)
    return f"{text}: {e.filename}" if e.filename else text


def _interpreter_dirs(*, names: bool = False) -> list[str]:
    """The Python installation `{python}` runs from (the virtualenv and its base interpreter),
    outside /usr (bound anyway): resolved paths, or with `names` the paths as this process
    names them (each bound at that name, from its resolved path)."""
    out: list[str] = []
    for p in (sys.prefix, sys.base_prefix, os.path.dirname(os.path.dirname(sys.executable))):
        for q in (p, os.path.realpath(p)) if names else (os.path.realpath(p),):
            if q not in out and q != "/" and q != "/usr" and not q.startswith("/usr/"):
                out.append(q)
    return out


def _check_script(command: str, cwd: str, readable: list[str]) -> None:
    """ValueError naming `agent.sandbox_binds` when `command` is `{python} SCRIPT ...` and
    SCRIPT is in none of the directories a sandboxed agent can read."""
    from slipstream.config.agent import python_command

    try:
        script = python_command(command).script
    except ValueError:  # a shell command: what it runs is its own business
        return
    if script is None:
        return
    real = os.path.realpath(_fill(script, cwd))
    if not any(real == d or real.startswith(d.rstrip("/") + "/") for d in readable):
        raise ValueError(f"agent.sandbox_binds: the agent's script {real} is in none of the "
                         f"paths a sandboxed agent can read; add its directory "
                         f"(now {readable})")  # fmt: skip


def _end(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait()


# ---- the template process (standard library only: it runs by path, outside slipstream) ---------


def _serve(control_fd: int, preload: list[str]) -> None:
    """The template's loop: import `preload`, answer b"R" (or b"F<why>" and exit), then per
    request fork a run and report b"P<pid>", later b"X<exit code>", on its reply socket. Ends
    at EOF on the control socket (the parent closed it or died)."""
    import importlib

    ctl = socket.socket(fileno=control_fd)
    for name in preload:
        try:
            importlib.import_module(name)
        except BaseException as e:  # noqa: BLE001 - any failure is the answer
            ctl.send(f"Fmodule {name!r} did not import: {type(e).__name__}: {e}".encode()[:4096])
            os._exit(1)
    sys.stdout.flush()
    sys.stderr.flush()
    ctl.send(b"R")
    sel = selectors.DefaultSelector()
    sel.register(ctl, selectors.EVENT_READ)
    runs: dict[int, tuple[int, socket.socket]] = {}  # pidfd -> (pid, reply socket)
    while True:
        for key, _ in sel.select():
            if key.fileobj is ctl:
                try:
                    body, fds, _, _ = socket.recv_fds(ctl, MAX_MESSAGE_BYTES, 4)
                except ConnectionResetError:
                    body, fds = b"", []
                if not body:
                    os._exit(0)
                stdin, stdout, stderr, reply_fd = fds
                reply = socket.socket(fileno=reply_fd)
                try:
                    pid = os.fork()
                except OSError as e:
                    reply.send(f"E{e}".encode())
                    reply.close()
                    pid = -1
                if pid == 0:
                    for fd, (_, other) in runs.items():
                        os.close(fd)
                        other.close()
                    sel.close()
                    ctl.close()
                    reply.close()
                    _run(json.loads(body), stdin, stdout, stderr)  # never returns
                for fd in (stdin, stdout, stderr):
                    os.close(fd)
                if pid > 0:
                    pidfd = os.pidfd_open(pid)
                    runs[pidfd] = (pid, reply)
                    sel.register(pidfd, selectors.EVENT_READ)
                    reply.send(b"P%d" % pid)
            else:
                pidfd = key.fd
                sel.unregister(pidfd)
                pid, reply = runs.pop(pidfd)
                os.close(pidfd)
                _, status = os.waitpid(pid, 0)
                try:
                    reply.send(b"X%d" % os.waitstatus_to_exitcode(status))
                except OSError:
                    pass  # the parent gave up on this run
                reply.close()


def _run(req: dict[str, Any], stdin: int, stdout: int, stderr: int) -> NoReturn:
    """In the forked child: become the run (module docstring), run the program, exit."""
    code = 126  # as the shell's `ulimit ... || exit 126`: the run could not be set up
    try:
        os.setsid()
        for fd, std in ((stdin, 0), (stdout, 1), (stderr, 2)):
            os.dup2(fd, std)
        os.closerange(3, os.sysconf("SC_OPEN_MAX"))  # Popen's close_fds: nothing else passed on
        limits = req["rlimits"]
        resource.setrlimit(resource.RLIMIT_AS, (limits["as"], limits["as"]))
        resource.setrlimit(resource.RLIMIT_FSIZE, (limits["fsize"], limits["fsize"]))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        os.chdir(req["cwd"])
        os.environ.clear()  # unsetenv/putenv too: the agent's own subprocesses see the same
        os.environ.update(req["env"])
        import runpy

        script, module = req["script"], req["module"]
        sys.argv = [script or "-m", *req["args"]]
        # `python SCRIPT` puts the script's directory first on sys.path, `python -m` the cwd
        sys.path.insert(0, os.path.dirname(os.path.realpath(script)) if script else os.getcwd())
    except BaseException:  # noqa: BLE001
        _report_and_exit(code)
    code = 0
    try:
        if script is not None:
            runpy.run_path(script, run_name="__main__")
        else:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        code = _exit_code(e.code)
    except KeyboardInterrupt:
        _report_and_exit(-signal.SIGINT)
    except BaseException:  # noqa: BLE001 - as the interpreter: traceback, exit 1
        _report_and_exit(1)
    _finish(code)


def _exit_code(code: object) -> int:
    """SystemExit's code as the interpreter exits with it: None 0, an int itself, else printed
    to stderr and 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _report_and_exit(code: int) -> NoReturn:
    """Print the exception being handled as the interpreter would (the frames of this file and
    of runpy left out: the traceback starts at the agent's code), then exit with `code`."""
    import runpy
    import traceback

    kind, value, tb = sys.exc_info()
    ours = {__file__, runpy.__file__, "<frozen runpy>"}  # 3.11 freezes runpy
    while tb is not None and tb.tb_frame.f_code.co_filename in ours:
        tb = tb.tb_next
    try:
        traceback.print_exception(kind, value, tb)
    except BaseException:  # noqa: BLE001 - stderr itself may be what failed
        pass
    _finish(code)


def _finish(code: int) -> NoReturn:
    """What the interpreter does at exit (join non-daemon threads, atexit, flush stdio), then
    exit without the template's own teardown."""
    try:
        threading._shutdown()  # type: ignore[attr-defined]  # Py_Finalize's wait for threads
        import atexit

        atexit._run_exitfuncs()
    except BaseException:  # noqa: BLE001
        pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:  # noqa: BLE001 - the interpreter exits 120 when flushing fails
            code = 120 if code == 0 else code
    if code < 0:  # killed by a signal, as the interpreter re-raises SIGINT
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code & 0xFF)
