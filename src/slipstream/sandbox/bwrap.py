"""`bwrap` backend: bubblewrap + a cgroup per sandbox + a seccomp filter; the guest agent is PID 2.

Each sandbox is one `bwrap` process started as an unprivileged uid (65534 by default, so even a
namespace escape lands as `nobody`), with:
- every namespace unshared (`--unshare-all`: user, mount, pid, net, ipc, uts, cgroup) — the network
  namespace holds only a down loopback, so nothing, not even the host's 127.0.0.1, is reachable;
- `--die-with-parent`, `--new-session` (no TIOCSTI into our terminal), `--cap-drop ALL`;
- read-only binds of /usr (and /bin, /lib*, /sbin as on the host: symlinks on merged-usr Debian),
  a minimal generated /etc (passwd, group, hosts, ld.so config; never the host's shadow), no /root,
  no /home; a private tmpfs work dir `/sandbox` and `/tmp`, sized by `template.workdir_mib`; the root
  itself remounted read-only;
- the seccomp filter of `seccomp.py` via `--seccomp FD`;
- a cgroup (memory+swap, pids, cpuset, CPU quota) entered before bwrap runs, so bwrap and
  everything below it is limited from its first instruction.

How it is started: a short exec chain, so Popen can vfork. A Python `preexec_fn` would force it
to fork this whole process (15-23 ms with torch and a model loaded, the GIL held). `/bin/sh`
(root) writes its own pid into the cgroup's cgroup.procs files, then execs `setpriv` (drop to the
sandbox uid and gid, no supplementary groups, no inheritable capabilities, parent-death signal
KILL), which execs `taskset` (the pinned CPUs, when pinned), which execs bwrap. The pid stays the
same across the chain, so the cgroup holds bwrap from its first instruction. If the pool dies in
the ~1 ms before setpriv sets the parent-death signal, the agent still exits when its channel
closes, and the journal entry written before the spawn lets orphan reaping remove the cgroup.

Not covered: GPU/device access (none is given), per-sandbox disk quotas beyond the tmpfs size,
architectures other than x86_64 (the seccomp filter is x86_64-only).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from pathlib import Path

from slipstream.sandbox.agent_client import agent_source_path
from slipstream.sandbox.base import Backend, SandboxTemplate
from slipstream.sandbox.cgroups import CgroupLimits, CgroupManager
from slipstream.sandbox.errors import BackendUnavailable
from slipstream.sandbox.journal import Journal, SandboxRecord, default_state_dir
from slipstream.sandbox.process import SubprocessSandbox, start_agent_subprocess
from slipstream.sandbox.seccomp import build_filter, filter_fd

log = logging.getLogger(__name__)

SANDBOX_WORKDIR = "/sandbox"
SH = "/bin/sh"
SETPRIV = "/usr/bin/setpriv"  # util-linux (Essential on Debian), like taskset
TASKSET = "/usr/bin/taskset"
# Run as root by /bin/sh: "$1".. up to "--" are cgroup.procs files to write our pid into; the rest
# is the command to exec. A failed write exits 125 with the shell's message on stderr (the
# agent's hello never comes, and create reports that stderr).
ENTER_CGROUP_SH = (
    'p=$$; while [ "$1" != -- ]; do echo "$p" > "$1" || exit 125; shift; done; shift; exec "$@"'
)
AGENT_IN_SANDBOX = "/opt/slipstream/agent.py"
NOBODY = 65534
ETC_FILES = {
    "passwd": "root:x:0:0:root:/sandbox:/bin/sh\nnobody:x:65534:65534:nobody:/sandbox:/bin/sh\n",
    "group": "root:x:0:\nnogroup:x:65534:\n",
    "hosts": "127.0.0.1 localhost sandbox\n",
    "hostname": "sandbox\n",
    "nsswitch.conf": "passwd: files\ngroup: files\nhosts: files\n",
}
ETC_COPIED = ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "alternatives", "localtime")
TOP_LEVEL = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")


class BwrapSandbox(SubprocessSandbox):
    backend_name = "bwrap"


class BwrapBackend(Backend):
    """bubblewrap sandboxes; see the module docstring for what is isolated and how."""

    name = "bwrap"
    isolating = True

    def __init__(
        self,
        state_dir: str | Path | None = None,
        journal: Journal | None = None,
        cgroup_root: str | Path = "/sys/fs/cgroup",
        uid: int = NOBODY,
        bwrap: str = "/usr/bin/bwrap",
        python: str = "/usr/bin/python3",
        rootfs_cache: str | Path = "/tmp/slipstream-bwrap-rootfs",
        **_: object,
    ) -> None:
        for exe in (bwrap, python, SH, SETPRIV, TASKSET):
            if not os.access(exe, os.X_OK):
                raise BackendUnavailable(f"bwrap backend needs {exe}, which is not executable")
        self.state_dir = Path(state_dir) if state_dir else default_state_dir()
        self.journal = journal
        self.uid = uid
        self.bwrap = bwrap
        self.python = python
        try:
            self.cgroups = CgroupManager.detect(cgroup_root)
        except OSError as e:
            raise BackendUnavailable(f"bwrap backend needs writable cgroups: {e}") from None
        try:
            self.seccomp_program = build_filter()
        except NotImplementedError as e:
            raise BackendUnavailable(f"bwrap backend: {e}") from None
        self.rootfs = self._stage(Path(rootfs_cache))
        self._fixed_args = self._static_args()

    def _stage(self, cache: Path) -> Path:
        """Agent copy + minimal /etc in a dir the sandbox uid can reach, keyed by content (a shared
        read-only cache: it outlives sandboxes, holds no per-sandbox state)."""
        agent = Path(agent_source_path()).read_bytes()
        key = hashlib.sha256(agent + repr(sorted(ETC_FILES.items())).encode()).hexdigest()[:12]
        root = cache / f"rootfs-{key}"
        if (root / "ready").exists():
            return root
        cache.mkdir(parents=True, exist_ok=True)
        os.chmod(cache, 0o755)
        for parent in cache.parents:
            if not os.stat(parent).st_mode & 0o001:
                raise BackendUnavailable(
                    f"bwrap rootfs cache {cache}: {parent} is not searchable by uid {self.uid}"
                )
        tmp = Path(tempfile.mkdtemp(prefix=".rootfs-", dir=cache))
        (tmp / "etc").mkdir()
        for name, text in ETC_FILES.items():
            (tmp / "etc" / name).write_text(text)
        for name in ETC_COPIED:
            src = Path("/etc") / name
            if src.is_symlink():
                os.symlink(os.readlink(src), tmp / "etc" / name)
            elif src.is_dir():
                shutil.copytree(src, tmp / "etc" / name, symlinks=True)
            elif src.is_file():
                shutil.copy(src, tmp / "etc" / name)
        (tmp / "agent.py").write_bytes(agent)
        (tmp / "ready").write_text("")
        for p in [tmp, *tmp.rglob("*")]:
            if not p.is_symlink():
                os.chmod(p, 0o755 if p.is_dir() else 0o644)
        try:
            os.rename(tmp, root)
        except OSError:  # another process staged it first
            shutil.rmtree(tmp, ignore_errors=True)
        return root

    def _static_args(self) -> list[str]:
        args = [
            "--unshare-all",
            "--die-with-parent",
            "--new-session",
            "--cap-drop",
            "ALL",
            "--hostname",
            "sandbox",
            "--ro-bind",
            "/usr",
            "/usr",
        ]
        for name in TOP_LEVEL:
            p = Path("/") / name
            if p.is_symlink():
                args += ["--symlink", os.readlink(p), str(p)]
            elif p.is_dir():
                args += ["--ro-bind", str(p), str(p)]
        args += [
            "--ro-bind",
            str(self.rootfs / "etc"),
            "/etc",
            "--ro-bind",
            str(self.rootfs / "agent.py"),
            AGENT_IN_SANDBOX,
            "--proc",
            "/proc",
            "--dev",
            "/dev",
        ]
        return args

    def argv(self, template: SandboxTemplate, seccomp_fd: int) -> list[str]:
        size = str(template.workdir_mib << 20)
        return [
            self.bwrap,
            *self._fixed_args,
            "--size",
            size,
            "--tmpfs",
            "/tmp",
            "--size",
            size,
            "--tmpfs",
            SANDBOX_WORKDIR,
            "--remount-ro",
            "/",
            "--chdir",
            SANDBOX_WORKDIR,
            "--clearenv",
            "--setenv",
            "PATH",
            "/usr/local/bin:/usr/bin:/bin",
            "--setenv",
            "HOME",
            SANDBOX_WORKDIR,
            "--seccomp",
            str(seccomp_fd),
            "--",
            self.python,
            "-I",
            "-S",
            AGENT_IN_SANDBOX,
            "--workdir",
            SANDBOX_WORKDIR,
        ]

    async def create(
        self,
        template: SandboxTemplate,
        *,
        sandbox_id: str,
        cpus: tuple[int, ...] | None = None,
        mems: tuple[int, ...] | None = None,
    ) -> BwrapSandbox:
        limits = CgroupLimits(
            memory_bytes=template.memory_mib << 20,
            pids_max=template.pids_max,
            vcpus=template.vcpus,
            cpus=cpus,
            mems=mems,
        )
        cgroup = self.cgroups.create(sandbox_id, limits)
        # Start at the lowest CPU weight: a warm pool refills while other sandboxes run commands,
        # and their latency matters more than how fast a spare sandbox gets ready.
        cgroup.set_cpu_weight(1)
        if self.journal:  # before any process exists: a crash from here on is reaped
            self.journal.write(
                SandboxRecord(sandbox_id=sandbox_id, backend=self.name, cgroup_paths=cgroup.dirs)
            )
        launch = launch_argv(cgroup.procs_files(), uid=self.uid, cpus=cpus)
        fd = filter_fd(self.seccomp_program)
        try:
            proc, conn, tail = await start_agent_subprocess(
                launch + self.argv(template, fd),
                sandbox_id=sandbox_id,
                template=template,
                pass_fds=(fd,),
            )
        except BaseException:
            cgroup.kill_and_remove()
            if self.journal:
                self.journal.remove(sandbox_id)
            raise
        finally:
            os.close(fd)
        cgroup.set_cpu_weight(100)
        sb = BwrapSandbox(
            sandbox_id,
            template,
            conn,
            cgroup=cgroup,
            cpus=cpus,
            mems=mems,
            journal=self.journal,
            proc=proc,
            dirs=[],
            stderr_tail=tail,
        )
        if self.journal:
            self.journal.write(sb.record())
        return sb


def launch_argv(procs_files: list[str], *, uid: int, cpus: tuple[int, ...] | None) -> list[str]:
    """The exec chain that starts bwrap inside its cgroup, as `uid`, pinned to `cpus` (module
    docstring). Prefix it to bwrap's argv; it needs root for the cgroup writes and the uid drop."""
    argv = [SH, "-c", ENTER_CGROUP_SH, "sh", *procs_files, "--", SETPRIV, "--pdeathsig", "KILL"]
    if uid != os.getuid() or uid != 0:
        argv += [f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--inh-caps=-all"]
    if cpus:
        argv += [TASKSET, "--cpu-list", ",".join(map(str, cpus))]
    return argv
