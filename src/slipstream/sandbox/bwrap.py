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
import stat
import tempfile
from pathlib import Path

from slipstream.rundir import UnsafeDirError, private_dir, runtime_root
from slipstream.sandbox.agent_client import agent_source_path
from slipstream.sandbox.base import Backend, SandboxTemplate
from slipstream.sandbox.cgroups import CgroupLimits, CgroupManager
from slipstream.sandbox.errors import BackendUnavailable
from slipstream.sandbox.journal import Journal, SandboxRecord
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
        *,
        cgroup_root: str | Path = "/sys/fs/cgroup",
        uid: int = NOBODY,
        bwrap: str = "/usr/bin/bwrap",
        python: str = "/usr/bin/python3",
        rootfs_cache: str | Path | None = None,
    ) -> None:
        for exe in (bwrap, python, SH, SETPRIV, TASKSET):
            if not os.access(exe, os.X_OK):
                raise BackendUnavailable(f"bwrap backend needs {exe}, which is not executable")
        super().__init__(state_dir, journal)
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
        self.rootfs = self._stage(Path(rootfs_cache or runtime_root() / "bwrap-rootfs"))
        self._fixed_args = self._static_args()

    @classmethod
    def probe(cls, boot: bool = False) -> tuple[bool, str]:
        ok, detail = super().probe(boot)
        if not ok:
            return ok, detail
        try:
            version = CgroupManager.detect().version
        except OSError as e:
            return False, str(e)
        return True, f"{detail}; cgroup v{version} writable; seccomp filter loaded"

    def _stage(self, cache: Path) -> Path:
        """Agent copy + minimal /etc in a dir the sandbox uid can reach: a cache that outlives
        sandboxes, holds no per-sandbox state, and is content-addressed. It lives in a private
        runtime dir (rundir: ours, not writable by others), and an existing entry is used only
        when the hash of what it contains (every path, mode, byte and link target) equals the
        hash of what we would stage; otherwise it is removed and staged again."""
        try:
            private_dir(cache, mode=0o755)
        except UnsafeDirError as e:
            raise BackendUnavailable(f"bwrap rootfs cache: {e}") from None
        os.chmod(cache, 0o755)  # ours (checked): the sandbox uid must search it
        for parent in Path(os.path.realpath(cache)).parents:
            if not os.stat(parent).st_mode & 0o001:
                raise BackendUnavailable(
                    f"bwrap rootfs cache {cache}: {parent} is not searchable by uid {self.uid}"
                )
        want = rootfs_entries(Path(agent_source_path()).read_bytes())
        digest = tree_digest(want)
        root = cache / f"rootfs-{digest[:16]}"
        if os.path.lexists(root):
            try:
                got = tree_digest(read_tree(root))
            except (OSError, ValueError) as e:
                got = f"unreadable ({e})"
            if got == digest:
                return root
            log.warning("bwrap rootfs cache %s does not hold what its name says (%s); restaging",
                        root, got if got.startswith("unreadable") else "content hash differs")  # fmt: skip
            if os.path.isdir(root) and not os.path.islink(root):
                shutil.rmtree(root)
            else:
                os.unlink(root)
        tmp = Path(tempfile.mkdtemp(prefix=".rootfs-", dir=cache))
        try:
            write_tree(tmp, want)
            os.chmod(tmp, 0o755)
            os.rename(tmp, root)
        except OSError:  # another process staged it first: verify theirs like any other entry
            shutil.rmtree(tmp, ignore_errors=True)
            if tree_digest(read_tree(root)) != digest:
                raise BackendUnavailable(f"bwrap rootfs cache {root}: staged by another process "
                                         "with other contents") from None  # fmt: skip
        return root

    def _static_args(self) -> list[str]:
        return [
            *isolation_args(self.rootfs / "etc"),
            "--ro-bind",
            str(self.rootfs / "agent.py"),
            AGENT_IN_SANDBOX,
        ]

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


def isolation_args(etc: Path) -> list[str]:
    """bwrap's arguments for what every sandbox of this module starts with (module docstring):
    every namespace unshared (the network namespace holds only its own loopback), dies with its
    parent, a new session, no capabilities; /usr and the top-level system dirs read-only, `etc`
    (a minimal /etc: `stage_etc`) as /etc, a fresh /proc and a minimal /dev. The backend's
    sandboxes and sandboxed agent runs (envs/agent_launch.py) both build on it."""
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
    return [*args, "--ro-bind", str(etc), "/etc", "--proc", "/proc", "--dev", "/dev"]


def stage_etc(root: Path) -> Path:
    """Write the minimal /etc a sandbox gets (generated passwd, group, hosts; the host's loader
    config and timezone; never its shadow) as `root`/etc, a directory that must not exist yet;
    -> that directory."""
    write_tree(root, {k: v for k, v in rootfs_entries(b"").items() if k.split("/")[0] == "etc"})
    return root / "etc"


# A tree as {relative path: (kind, mode, data)}: kind "d" (dir, data b""), "f" (file, its bytes)
# or "l" (symlink, its target). What `rootfs_entries` wants, `write_tree` makes and `read_tree`
# reads back, so a cache entry is verified by what it holds, not by its name.
Tree = dict[str, tuple[str, int, bytes]]
ROOTFS_FILE_MAX_BYTES = 64 << 20
"""A staged /etc file larger than this is not one we wrote (ld.so.cache is ~100 KB)."""


def rootfs_entries(agent: bytes) -> Tree:
    tree: Tree = {"etc": ("d", 0o755, b""), "agent.py": ("f", 0o644, agent)}
    for name, text in ETC_FILES.items():
        tree[f"etc/{name}"] = ("f", 0o644, text.encode())
    for name in ETC_COPIED:
        src = Path("/etc") / name
        if src.is_symlink():
            tree[f"etc/{name}"] = ("l", 0, os.readlink(src).encode())
        elif src.is_dir():
            tree[f"etc/{name}"] = ("d", 0o755, b"")
            for dirpath, dirnames, filenames in os.walk(src):
                for n in dirnames + filenames:
                    p = Path(dirpath) / n
                    rel = f"etc/{p.relative_to('/etc')}"
                    if p.is_symlink():
                        tree[rel] = ("l", 0, os.readlink(p).encode())
                    elif p.is_dir():
                        tree[rel] = ("d", 0o755, b"")
                    elif p.is_file():
                        tree[rel] = ("f", 0o644, p.read_bytes())
        elif src.is_file():
            tree[f"etc/{name}"] = ("f", 0o644, src.read_bytes())
    return tree


def tree_digest(tree: Tree) -> str:
    h = hashlib.sha256()
    for rel in sorted(tree):
        kind, mode, data = tree[rel]
        h.update(f"{rel}\0{kind}\0{mode:o}\0{len(data)}\0".encode())
        h.update(data)
    return h.hexdigest()


def write_tree(root: Path, tree: Tree) -> None:
    for rel in sorted(tree):  # parents sort before their children
        kind, mode, data = tree[rel]
        p = root / rel
        if kind == "d":
            p.mkdir()
        elif kind == "l":
            os.symlink(data.decode(), p)
        else:
            fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
        if kind != "l":
            os.chmod(p, mode)


def read_tree(root: Path) -> Tree:
    """What `root` holds, links not followed; ValueError for anything we never write (a file
    of another owner, a device, a FIFO, a file too big)."""
    tree: Tree = {}
    euid = os.geteuid()
    for dirpath, dirnames, filenames in os.walk(root):
        for n in dirnames + filenames:
            p = Path(dirpath) / n
            rel = str(p.relative_to(root))
            st = os.lstat(p)
            if st.st_uid != euid:
                raise ValueError(f"{p} is owned by uid {st.st_uid}")
            mode = stat.S_IMODE(st.st_mode)
            if stat.S_ISLNK(st.st_mode):
                tree[rel] = ("l", 0, os.readlink(p).encode())
            elif stat.S_ISDIR(st.st_mode):
                tree[rel] = ("d", mode, b"")
            elif stat.S_ISREG(st.st_mode) and st.st_size <= ROOTFS_FILE_MAX_BYTES:
                fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
                with os.fdopen(fd, "rb") as f:
                    tree[rel] = ("f", mode, f.read())
            else:
                raise ValueError(f"{p} is not a directory, link or small regular file")
    return tree


def launch_argv(procs_files: list[str], *, uid: int, cpus: tuple[int, ...] | None) -> list[str]:
    """The exec chain that starts bwrap inside its cgroup, as `uid`, pinned to `cpus` (module
    docstring). Prefix it to bwrap's argv; it needs root for the cgroup writes and the uid drop."""
    argv = [SH, "-c", ENTER_CGROUP_SH, "sh", *procs_files, "--", SETPRIV, "--pdeathsig", "KILL"]
    if uid != os.getuid() or uid != 0:
        argv += [f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--inh-caps=-all"]
    if cpus:
        argv += [TASKSET, "--cpu-list", ",".join(map(str, cpus))]
    return argv
