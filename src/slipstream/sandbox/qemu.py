"""`qemu` backend: one QEMU `-M microvm` guest per sandbox, driven through the guest agent.

The guest is the cached image from `image.build_image()` (Debian cloud kernel + busybox/Python/agent
initramfs). The control channel is a virtio-serial port named `org.slipstream.agent`, backed on the
host by a Unix socket that we listen on and QEMU connects to at startup; the guest's `/init` finds
the port and runs the agent on it (`--device /dev/vportNpM`). The kernel console goes to
`<run_dir>/console.log` (quoted in errors when a guest fails to boot).

Acceleration: KVM when `kvm.probe_kvm()` proved by a real boot that KVM guests run here, else TCG
(logged once). Placement: QEMU starts inside a per-sandbox cgroup (cgroups.py: cpuset from the
pool's pinning, memory = guest RAM + QEMU overhead, pids); without a cgroup manager (not root)
it falls back to CPU affinity only (logged once, recorded in `QemuBackend.fallbacks`).

Isolation comes from the VM boundary: the guest has no network device, no disk, no shared
filesystem; QEMU runs with `-sandbox on` (seccomp: no spawning, no privilege changes).
Not covered: guest-internal OOM kills are reported as signal 9, not `oom_killed` (only an OOM kill
of QEMU itself, which breaks the sandbox, is visible to the host cgroup); snapshots; disks.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import socket
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from slipstream.rundir import process_start_ticks
from slipstream.sandbox.agent_client import AgentConnection
from slipstream.sandbox.base import AgentSandbox, Backend, SandboxTemplate
from slipstream.sandbox.errors import BackendUnavailable, SandboxBroken
from slipstream.sandbox.image import ImagePaths, build_image
from slipstream.sandbox.journal import Journal, SandboxRecord
from slipstream.sandbox.process import set_pdeathsig
from slipstream.sandbox.qemu_cmdline import QEMU_BINARY, qemu_argv

if TYPE_CHECKING:
    from slipstream.sandbox.cgroups import Cgroup

log = logging.getLogger(__name__)

RUN_DIR_PREFIX = "slipstream-qemu-"
# QEMU's own memory next to guest RAM: binary, TCG translation cache (qemu_cmdline.py caps it),
# I/O buffers.
QEMU_OVERHEAD_MIB = 192
# QEMU threads (vCPUs, I/O, RCU, workers) count against pids.max of its cgroup.
QEMU_PIDS_MAX = 128


def _tail(path: Path, num_bytes: int = 2000) -> str:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return ""
    return data[-num_bytes:].decode("utf-8", "replace").strip()


class MicroVM:
    """A running QEMU microVM with its agent connected. `boot_s`: process start -> agent hello."""

    def __init__(self, proc: asyncio.subprocess.Process, conn: AgentConnection, run_dir: Path,
                 boot_s: float, accel: str) -> None:  # fmt: skip
        self.proc = proc
        self.conn = conn
        self.run_dir = run_dir
        self.boot_s = boot_s
        self.accel = accel
        self.start_ticks = process_start_ticks(proc.pid)

    async def stop(self) -> None:
        """Kill QEMU (the guest is disposable: no clean shutdown needed) and remove the run dir."""
        await self.conn.close()
        if self.proc.returncode is None:
            try:
                self.proc.kill()
            except ProcessLookupError:
                pass
        await self.proc.wait()
        shutil.rmtree(self.run_dir, ignore_errors=True)


async def boot_microvm(
    image: ImagePaths,
    *,
    memory_mib: int,
    vcpus: int,
    accel: str,
    name: str,
    hello_timeout_s: float,
    preexec_fn=None,  # noqa: ANN001 - a fork-safe callable run in the child (cgroup entry, affinity)
    qemu_binary: str = QEMU_BINARY,
    on_run_dir=None,  # noqa: ANN001 - called with the run dir before QEMU starts (journal)
    pids_max: int = 256,
    workdir_mib: int = 256,
) -> MicroVM:
    """Start QEMU and wait for the agent's hello. On failure QEMU is killed, the run dir removed,
    and SandboxBroken quotes QEMU's stderr and the guest console."""
    run_dir = Path(tempfile.mkdtemp(prefix=RUN_DIR_PREFIX))
    if on_run_dir is not None:
        on_run_dir(run_dir)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(run_dir / "ctl.sock"))
    listener.listen(1)
    listener.setblocking(False)
    argv = qemu_argv(image, run_dir, memory_mib=memory_mib, vcpus=vcpus, accel=accel, name=name,
                     qemu_binary=qemu_binary, pids_max=pids_max, workdir_mib=workdir_mib)  # fmt: skip
    t0 = time.perf_counter()
    proc = None
    conn = None
    try:
        with open(run_dir / "qemu.log", "wb") as qemu_log:
            proc = await asyncio.create_subprocess_exec(
                *argv, stdin=asyncio.subprocess.DEVNULL, stdout=qemu_log, stderr=qemu_log,
                preexec_fn=preexec_fn, start_new_session=True,
            )  # fmt: skip
        conn = await asyncio.wait_for(_connect(proc, listener, name), hello_timeout_s)
        await conn.wait_hello(max(hello_timeout_s - (time.perf_counter() - t0), 0.1))
    except BaseException as e:  # noqa: BLE001 - cleanup on anything (cancellation too), then re-raise
        if conn is not None:
            conn.writer.close()
        if proc is not None and proc.returncode is None:
            proc.kill()
        if proc is not None:
            await proc.wait()
        if not isinstance(e, TimeoutError | SandboxBroken | OSError):
            shutil.rmtree(run_dir, ignore_errors=True)
            raise
        detail = (
            f"{name}: QEMU ({accel}) did not bring up the guest agent within {hello_timeout_s} s: "
            f"{type(e).__name__}: {e}; exit={proc.returncode if proc else None}; "
            f"qemu stderr: {_tail(run_dir / 'qemu.log', 800)!r}; "
            f"guest console: {_tail(run_dir / 'console.log')!r}"
        )
        shutil.rmtree(run_dir, ignore_errors=True)
        raise SandboxBroken(detail) from None
    finally:
        listener.close()
    return MicroVM(proc, conn, run_dir, time.perf_counter() - t0, accel)


async def _connect(
    proc: asyncio.subprocess.Process, listener: socket.socket, name: str
) -> AgentConnection:
    """Accept QEMU's connection to the control socket, unless QEMU exits first."""
    loop = asyncio.get_running_loop()
    accept = asyncio.ensure_future(loop.sock_accept(listener))
    exited = asyncio.ensure_future(proc.wait())
    try:
        done, _ = await asyncio.wait({accept, exited}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        exited.cancel()
        if not accept.done():
            accept.cancel()
    if accept not in done:
        raise SandboxBroken(f"QEMU exited with status {proc.returncode} before connecting")
    conn_sock, _ = accept.result()
    reader, writer = await asyncio.open_unix_connection(sock=conn_sock, limit=1 << 20)
    return AgentConnection(reader, writer, name=name)


class QemuSandbox(AgentSandbox):
    """A sandbox in a QEMU microVM. `boot_s` is its cold boot time (QEMU start -> agent hello)."""

    def __init__(self, sandbox_id: str, template: SandboxTemplate, vm: MicroVM, cgroup: Cgroup | None,
                 cpus: tuple[int, ...] | None, mems: tuple[int, ...] | None,
                 journal: Journal | None) -> None:  # fmt: skip
        # The QEMU cgroup is not handed to AgentSandbox: its peak memory would be QEMU's (guest RAM
        # included), not the command's; exec reports the agent's max RSS instead.
        super().__init__(sandbox_id, template, vm.conn, cpus=cpus, mems=mems, journal=journal)
        self.vm = vm
        self.qemu_cgroup = cgroup
        self.boot_s = vm.boot_s
        self.accel = vm.accel

    async def _destroy(self) -> None:
        await self.vm.stop()
        if self.qemu_cgroup is not None:
            await asyncio.to_thread(self.qemu_cgroup.kill_and_remove)

    def record(self) -> SandboxRecord:
        return SandboxRecord(
            sandbox_id=self.sandbox_id,
            backend="qemu",
            pid=self.vm.proc.pid,
            pid_start_ticks=self.vm.start_ticks,
            cgroup_paths=self.qemu_cgroup.dirs if self.qemu_cgroup is not None else [],
            dirs=[str(self.vm.run_dir)],
            extra={"accel": self.accel, "boot_s": round(self.boot_s, 3)},
        )


class QemuBackend(Backend):
    """Creates QEMU microVM sandboxes. `accel`: "kvm", "tcg" or None (probe: KVM if a test boot
    works, else TCG). `use_cgroups=False` skips the per-VM cgroup (affinity only)."""

    name = "qemu"
    isolating = True

    def __init__(self, state_dir: str | Path | None = None, journal: Journal | None = None, *,
                 accel: str | None = None, cache_dir: str | Path | None = None,
                 use_cgroups: bool = True, qemu_binary: str = QEMU_BINARY) -> None:  # fmt: skip
        if accel not in (None, "kvm", "tcg"):
            raise ValueError(f"qemu accel {accel!r} is not one of kvm, tcg, None (auto)")
        super().__init__(state_dir, journal)
        self.accel = accel
        self.cache_dir = cache_dir
        self.use_cgroups = use_cgroups
        self.qemu_binary = qemu_binary
        self.fallbacks: list[str] = []
        self.boot_times_s: list[float] = []
        self._default_image: ImagePaths | None = None
        self._cgroups = None
        self._init_lock = asyncio.Lock()

    @classmethod
    def probe(cls, boot: bool = False) -> tuple[bool, str]:
        return probe(boot)

    def _fallback(self, what: str) -> None:
        if what not in self.fallbacks:
            self.fallbacks.append(what)
            log.warning("qemu backend: %s", what)

    async def _setup(self, template: SandboxTemplate) -> ImagePaths:
        async with self._init_lock:
            if shutil.which(self.qemu_binary) is None:
                raise BackendUnavailable(
                    f"{self.qemu_binary} not found (Debian package qemu-system-x86)"
                )
            if template.image is not None:
                image = image_from_dir(template.image)
            else:
                if self._default_image is None:
                    try:
                        self._default_image = await asyncio.to_thread(build_image, self.cache_dir)
                    except RuntimeError as e:  # no kernel, busybox-static or guest Python
                        raise BackendUnavailable(
                            f"qemu: guest image cannot be built: {e}"
                        ) from None
                image = self._default_image
            if self.accel is None:
                from slipstream.sandbox.kvm import probe_kvm

                ok, reason = await asyncio.to_thread(probe_kvm, image, qemu_binary=self.qemu_binary)
                self.accel = "kvm" if ok else "tcg"
                if not ok:
                    self._fallback(f"KVM unusable ({reason}); using TCG (emulation, ~10x slower)")
            if self.use_cgroups and self._cgroups is None:
                from slipstream.sandbox.cgroups import CgroupManager

                try:
                    self._cgroups = CgroupManager.detect()
                except OSError as e:
                    self.use_cgroups = False
                    self._fallback(
                        f"no cgroups ({e}); QEMU gets CPU affinity only, no memory limit"
                    )
            return image

    async def create(self, template: SandboxTemplate, *, sandbox_id: str,
                     cpus: tuple[int, ...] | None = None,
                     mems: tuple[int, ...] | None = None) -> QemuSandbox:  # fmt: skip
        image = await self._setup(template)
        cgroup = None
        enter = None
        if self._cgroups is not None:
            from slipstream.sandbox.cgroups import CgroupLimits

            limits = CgroupLimits(
                memory_bytes=(template.memory_mib + QEMU_OVERHEAD_MIB) << 20,
                pids_max=QEMU_PIDS_MAX, vcpus=template.vcpus, cpus=cpus, mems=mems,
            )  # fmt: skip
            cgroup = await asyncio.to_thread(self._cgroups.create, f"qemu-{sandbox_id}", limits)
            enter = cgroup.enter_fn()
        cpu_set = set(cpus) if cpus else None

        def preexec() -> None:
            if enter is not None:
                enter()
            set_pdeathsig()  # QEMU dies with its owner; the journal covers a crash in between
            if cpu_set:
                os.sched_setaffinity(0, cpu_set)

        def journal_early(run_dir: Path) -> None:
            if self.journal is not None:  # before QEMU exists: a crash from here on is reaped
                self.journal.write(SandboxRecord(
                    sandbox_id=sandbox_id, backend=self.name,
                    cgroup_paths=cgroup.dirs if cgroup is not None else [], dirs=[str(run_dir)],
                ))  # fmt: skip

        try:
            vm = await boot_microvm(
                image, memory_mib=template.memory_mib, vcpus=template.vcpus, accel=self.accel or "tcg",
                name=f"slipstream-{sandbox_id}", hello_timeout_s=template.create_timeout_s,
                preexec_fn=preexec, qemu_binary=self.qemu_binary, on_run_dir=journal_early,
                pids_max=template.pids_max, workdir_mib=template.workdir_mib,
            )  # fmt: skip
        except BaseException:
            if cgroup is not None:
                await asyncio.to_thread(cgroup.kill_and_remove)
            if self.journal is not None:
                self.journal.remove(sandbox_id)
            raise
        self.boot_times_s.append(vm.boot_s)
        sb = QemuSandbox(sandbox_id, template, vm, cgroup, cpus, mems, self.journal)
        if self.journal is not None:
            self.journal.write(sb.record())
        return sb


def image_from_dir(path: str | Path) -> ImagePaths:
    """A built image directory (as `build_image` writes it)."""
    d = Path(path)
    paths = ImagePaths(d / "vmlinuz", d / "initramfs.cpio.gz", d / "manifest.json")
    for p in (paths.kernel, paths.initramfs):
        if not p.is_file():
            raise BackendUnavailable(f"guest image {d}: {p.name} is missing")
    return paths


def probe(boot: bool = False) -> tuple[bool, str]:
    """Can this host run qemu sandboxes? Checks QEMU, the guest image inputs (building the image,
    cached), and KVM (by a cached test boot). `boot=True` also boots one TCG/KVM guest."""
    if shutil.which(QEMU_BINARY) is None:
        return False, f"{QEMU_BINARY} not found (install the Debian package qemu-system-x86)"
    try:
        image = build_image()
    except (RuntimeError, OSError, FileNotFoundError) as e:
        return False, f"guest image cannot be built: {e}"
    from slipstream.sandbox.kvm import probe_kvm

    kvm_ok, kvm_reason = probe_kvm(image)
    accel = "kvm" if kvm_ok else "tcg"
    note = "KVM" if kvm_ok else f"TCG emulation (KVM: {kvm_reason})"
    if boot:

        async def once() -> float:
            vm = await boot_microvm(image, memory_mib=256, vcpus=1, accel=accel, name="slipstream-probe",
                                    hello_timeout_s=60.0)  # fmt: skip
            await vm.stop()
            return vm.boot_s

        try:
            boot_s = asyncio.run(once())
        except SandboxBroken as e:
            return False, str(e)
        note += f", test boot {boot_s:.2f} s"
    return True, f"QEMU microVM with {note}; image {image.kernel.parent}"
