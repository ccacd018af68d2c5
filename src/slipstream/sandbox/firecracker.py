"""`firecracker` backend: one jailed Firecracker microVM per sandbox, agent over vsock.

Lifecycle of `FirecrackerBackend.create`:
1. The guest image of `image.build_image()` (same initramfs as QEMU); Firecracker on x86_64 loads an
   ELF kernel, so the bzImage's payload is extracted once into `<image>/vmlinux`.
2. A chroot `<chroot_base>/firecracker/<id>/root` gets hard links (or copies) of vmlinux and the
   initramfs, owned by the jail uid. The journal records the chroot and the jailer's cgroups first.
3. `jailer --id <id> --exec-file <firecracker> --uid --gid --chroot-base-dir --cgroup-version 1|2
   --parent-cgroup slipstream-fc --cgroup cpuset.cpus=.. --cgroup cpuset.mems=.. (NUMA placement)
   --cgroup memory limit -- --api-sock /api.sock`.
4. `boot_sequence()` over the API socket: logger, metrics, serial, boot-source (kernel, initrd,
   boot args with `slipstream.ctl=vsock:52`), machine-config, vsock (CID 3, /v.sock), InstanceStart.
5. Host side of vsock: connect to `<root>/v.sock`, send `CONNECT 10052\\n`, expect `OK <port>\\n`
   (retried until the guest agent listens), then the agent's frames; wait for hello.

Contract-tested, not run, on hosts without `firecracker`/`jailer` on PATH and a working KVM (the
development machines): tests/unit/test_firecracker_api.py validates every API request of
`boot_sequence()` against the Firecracker 1.17 OpenAPI spec and runs the vsock handshake and the real
guest agent against fakes. Unverified here: that this Debian cloud kernel finds Firecracker's
virtio-mmio devices (it lacks CONFIG_VIRTIO_MMIO_CMDLINE_DEVICES, so it relies on Firecracker's
ACPI device description, available in recent x86_64 releases).
"""

from __future__ import annotations

import asyncio
import gzip
import logging
import lzma
import os
import shutil
import struct
import subprocess
import time
from pathlib import Path

from slipstream.rundir import process_start_ticks
from slipstream.sandbox.agent_client import AgentConnection
from slipstream.sandbox.base import AgentSandbox, Backend, SandboxTemplate
from slipstream.sandbox.errors import BackendUnavailable, SandboxBroken
from slipstream.sandbox.firecracker_api import FirecrackerAPI, FirecrackerAPIError
from slipstream.sandbox.image import ImagePaths, build_image
from slipstream.sandbox.journal import Journal, SandboxRecord

log = logging.getLogger(__name__)

AGENT_VSOCK_PORT = (
    10052  # >= 1024: the unprivileged guest agent may bind it (vsock reserves < 1024)
)
GUEST_CID = 3
PARENT_CGROUP = "slipstream-fc"
VMM_OVERHEAD_MIB = 64  # Firecracker's own memory (<= 5 MiB per its spec) plus page tables, slack
BOOT_ARGS = (
    "console=ttyS0 quiet reboot=k panic=-1 pci=off mitigations=off random.trust_cpu=on cryptomgr.notests "
    f"slipstream.ctl=vsock:{AGENT_VSOCK_PORT}"
)
# Paths inside the jail (the chroot is the API's filesystem root).
JAIL_KERNEL, JAIL_INITRD, JAIL_API, JAIL_VSOCK = (
    "/vmlinux",
    "/initramfs.cpio.gz",
    "/api.sock",
    "/v.sock",
)
JAIL_LOG, JAIL_METRICS, JAIL_CONSOLE = "/firecracker.log", "/metrics.json", "/console.log"


# ---------------------------------------------------------------------------------- kernel


def extract_vmlinux(bzimage: bytes) -> bytes:
    """The ELF kernel inside a bzImage (as the kernel's scripts/extract-vmlinux): the setup header's
    payload_offset/payload_length locate the compressed stream; gzip and xz are decoded in-process,
    LZ4 (Debian's cloud kernels) with the `lz4` tool (Debian package lz4)."""
    if bzimage[0x202:0x206] != b"HdrS":
        raise RuntimeError("not a bzImage: no HdrS setup header")
    setup_sects = bzimage[0x1F1] or 4
    payload_offset, payload_length = struct.unpack_from("<II", bzimage, 0x248)
    start = (setup_sects + 1) * 512 + payload_offset
    payload = bzimage[start : start + payload_length]
    if payload.startswith(b"\x1f\x8b"):
        data = gzip.decompress(payload)
    elif payload.startswith(b"\xfd7zXZ\x00"):
        data = lzma.LZMADecompressor().decompress(payload)
    elif payload.startswith(b"\x02\x21\x4c\x18"):  # LZ4 legacy frame, as the kernel writes it
        if shutil.which("lz4") is None:
            raise RuntimeError("the kernel is LZ4-compressed: install the Debian package lz4")
        # The kernel appends the uncompressed size after the frame; lz4 complains about it after
        # writing the whole payload, so the ELF check below decides, not the exit status.
        data = subprocess.run(["lz4", "-dc"], input=payload, capture_output=True).stdout
    else:
        raise RuntimeError(f"unsupported bzImage payload (magic {payload[:6].hex()})")
    if not data.startswith(b"\x7fELF"):
        raise RuntimeError("decompressed bzImage payload is not an ELF kernel")
    return data


def ensure_vmlinux(paths: ImagePaths) -> Path:
    """`<image>/vmlinux`, extracted from the bzImage on first use."""
    out = paths.vmlinux
    if not out.exists():
        tmp = out.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_bytes(extract_vmlinux(paths.kernel.read_bytes()))
        os.rename(tmp, out)
    return out


# ---------------------------------------------------------------------------------- pieces


def jailer_argv(*, vm_id: str, firecracker: str, jailer: str, uid: int, gid: int, chroot_base: Path,
                cgroup_version: int, memory_mib: int, cpus: tuple[int, ...] | None,
                mems: tuple[int, ...] | None) -> list[str]:  # fmt: skip
    """The jailer command line. cpuset.mems pins guest memory to NUMA nodes (`local` placement)."""
    from slipstream.sandbox.host_topology import format_cpulist

    mem_key = "memory.limit_in_bytes" if cgroup_version == 1 else "memory.max"
    argv = [jailer, "--id", vm_id, "--exec-file", firecracker, "--uid", str(uid), "--gid", str(gid),
            "--chroot-base-dir", str(chroot_base), "--cgroup-version", str(cgroup_version),
            "--parent-cgroup", PARENT_CGROUP,
            "--cgroup", f"{mem_key}={(memory_mib + VMM_OVERHEAD_MIB) << 20}"]  # fmt: skip
    if cpus:
        argv += ["--cgroup", f"cpuset.cpus={format_cpulist(cpus)}"]
    if mems:
        argv += ["--cgroup", f"cpuset.mems={format_cpulist(mems)}"]
    return argv + ["--", "--api-sock", JAIL_API]


def jailer_cgroup_dirs(
    vm_id: str, cgroup_version: int, root: Path = Path("/sys/fs/cgroup")
) -> list[str]:
    """Where the jailer creates this VM's cgroups (for cleanup and the journal)."""
    if cgroup_version == 2:
        return [str(root / PARENT_CGROUP / vm_id)]
    return [str(root / c / PARENT_CGROUP / vm_id) for c in ("cpuset", "memory", "pids", "cpu")]


async def boot_sequence(api: FirecrackerAPI, *, vcpus: int, memory_mib: int, pids_max: int = 256,
                        workdir_mib: int = 256) -> None:  # fmt: skip
    """Configure a fresh Firecracker (paths are inside its jail) and start the guest."""
    boot_args = f"{BOOT_ARGS} slipstream.pids_max={pids_max} slipstream.workdir_mib={workdir_mib}"
    await api.put_logger(JAIL_LOG, level="Warning")
    await api.put_metrics(JAIL_METRICS)
    await api.put_serial(JAIL_CONSOLE)
    await api.put_boot_source(JAIL_KERNEL, initrd_path=JAIL_INITRD, boot_args=boot_args)
    await api.put_machine_config(vcpu_count=vcpus, mem_size_mib=memory_mib, smt=False)
    await api.put_vsock(guest_cid=GUEST_CID, uds_path=JAIL_VSOCK)
    await api.put_entropy()
    await api.start()


async def vsock_connect(uds_path: str | Path, port: int, timeout_s: float,
                        name: str = "firecracker") -> AgentConnection:  # fmt: skip
    """Host-initiated vsock connection through Firecracker's Unix socket: `CONNECT <port>\\n`, then
    `OK <host port>\\n`. Firecracker drops the connection while nothing in the guest listens on the
    port yet, so this retries until `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    last = "no attempt"
    while time.monotonic() < deadline:
        try:
            reader, writer = await asyncio.open_unix_connection(str(uds_path), limit=1 << 20)
        except (FileNotFoundError, ConnectionRefusedError) as e:
            last = f"{type(e).__name__}: {e}"
            await asyncio.sleep(0.02)
            continue
        try:
            writer.write(f"CONNECT {port}\n".encode())
            await writer.drain()
            line = await asyncio.wait_for(reader.readline(), max(deadline - time.monotonic(), 0.01))
        except (ConnectionError, TimeoutError) as e:
            line, last = b"", f"{type(e).__name__}: {e}"
        if line.startswith(b"OK "):
            return AgentConnection(reader, writer, name=name)
        last = f"answer {line!r}" if line else last
        writer.close()
        await asyncio.sleep(0.02)
    raise SandboxBroken(
        f"{name}: vsock CONNECT {port} via {uds_path} failed for {timeout_s} s ({last})"
    )


def probe() -> tuple[bool, str]:
    """Can this host run Firecracker sandboxes? (binaries on PATH, KVM device usable, root)."""
    from slipstream.sandbox.kvm import kvm_device_usable

    missing = [b for b in ("firecracker", "jailer") if shutil.which(b) is None]
    if missing:
        return False, (f"{' and '.join(missing)} not on PATH; the backend is contract-tested only "
                       "(API requests validated against the Firecracker OpenAPI spec)")  # fmt: skip
    ok, reason = kvm_device_usable()
    if not ok:
        return False, reason
    if os.geteuid() != 0:
        return False, "the jailer needs root (chroot, cgroups, mknod /dev/kvm)"
    return True, f"firecracker and jailer found; {reason}"


# ---------------------------------------------------------------------------------- backend


class FirecrackerSandbox(AgentSandbox):
    def __init__(self, sandbox_id: str, template: SandboxTemplate, conn: AgentConnection, *,
                 proc: asyncio.subprocess.Process, jail_dir: Path, cgroup_dirs: list[str],
                 boot_s: float, cpus, mems, journal: Journal | None) -> None:  # noqa: ANN001  # fmt: skip
        super().__init__(sandbox_id, template, conn, cpus=cpus, mems=mems, journal=journal)
        self.proc, self.jail_dir, self.cgroup_dirs, self.boot_s = (
            proc,
            jail_dir,
            cgroup_dirs,
            boot_s,
        )
        self.start_ticks = process_start_ticks(proc.pid)

    async def _destroy(self) -> None:
        await self.conn.close()
        await _kill_and_clean(self.proc, self.jail_dir, self.cgroup_dirs)

    def record(self) -> SandboxRecord:
        return SandboxRecord(sandbox_id=self.sandbox_id, backend="firecracker", pid=self.proc.pid,
                             pid_start_ticks=self.start_ticks, cgroup_paths=list(self.cgroup_dirs),
                             dirs=[str(self.jail_dir)], extra={"boot_s": round(self.boot_s, 3)})  # fmt: skip


async def _kill_and_clean(
    proc: asyncio.subprocess.Process | None, jail_dir: Path, cgroup_dirs: list[str]
) -> None:
    from slipstream.sandbox.cgroups import remove_cgroup_dirs

    if proc is not None:
        if proc.returncode is None:
            try:
                proc.kill()
            except ProcessLookupError:
                pass
        await proc.wait()
    await asyncio.to_thread(remove_cgroup_dirs, cgroup_dirs)
    shutil.rmtree(jail_dir, ignore_errors=True)


class FirecrackerBackend(Backend):
    """Jailed Firecracker microVMs. `uid`/`gid`: the unprivileged ids Firecracker runs as."""

    name = "firecracker"
    isolating = True

    def __init__(self, state_dir: str | Path | None = None, journal: Journal | None = None, *,
                 uid: int = 65534, gid: int = 65534, cache_dir: str | Path | None = None) -> None:  # fmt: skip
        super().__init__(state_dir, journal)
        self.chroot_base = self.state_dir / "jailer"
        self.uid, self.gid, self.cache_dir = uid, gid, cache_dir
        self.cgroup_version = 2 if Path("/sys/fs/cgroup/cgroup.controllers").exists() else 1
        self.boot_times_s: list[float] = []

    @classmethod
    def probe(cls, boot: bool = False) -> tuple[bool, str]:
        return probe()  # no test boot: a boot needs root and KVM, which probe() checks

    async def create(self, template: SandboxTemplate, *, sandbox_id: str,
                     cpus: tuple[int, ...] | None = None,
                     mems: tuple[int, ...] | None = None) -> FirecrackerSandbox:  # fmt: skip
        ok, reason = probe()
        if not ok:
            raise BackendUnavailable(f"firecracker: {reason}")
        try:
            image = await asyncio.to_thread(build_image, self.cache_dir)
            vmlinux = await asyncio.to_thread(ensure_vmlinux, image)
        except RuntimeError as e:
            raise BackendUnavailable(f"firecracker: guest image cannot be built: {e}") from None
        jail_dir = self.chroot_base / "firecracker" / sandbox_id
        root = jail_dir / "root"
        cgroup_dirs = jailer_cgroup_dirs(sandbox_id, self.cgroup_version)
        if self.journal is not None:  # before anything exists: a crash from here on is reaped
            self.journal.write(SandboxRecord(sandbox_id=sandbox_id, backend=self.name,
                                             cgroup_paths=cgroup_dirs, dirs=[str(jail_dir)]))  # fmt: skip
        proc = None
        t0 = time.perf_counter()
        try:
            root.mkdir(parents=True)
            for src, dst in ((vmlinux, JAIL_KERNEL), (image.initramfs, JAIL_INITRD)):
                _link_or_copy(src, root / dst.lstrip("/"))
            for f in (JAIL_LOG, JAIL_METRICS, JAIL_CONSOLE):
                (root / f.lstrip("/")).touch()
                os.chown(root / f.lstrip("/"), self.uid, self.gid)
            argv = jailer_argv(vm_id=sandbox_id, firecracker=shutil.which("firecracker") or "firecracker",
                               jailer=shutil.which("jailer") or "jailer", uid=self.uid, gid=self.gid,
                               chroot_base=self.chroot_base, cgroup_version=self.cgroup_version,
                               memory_mib=template.memory_mib, cpus=cpus, mems=mems)  # fmt: skip
            from slipstream.sandbox.process import set_pdeathsig

            with open(jail_dir / "jailer.log", "wb") as out:
                proc = await asyncio.create_subprocess_exec(*argv, stdin=asyncio.subprocess.DEVNULL,
                                                            stdout=out, stderr=out, preexec_fn=set_pdeathsig)  # fmt: skip
            async with FirecrackerAPI(str(root / JAIL_API.lstrip("/"))) as api:
                await api.wait_ready(timeout_s=10.0)
                await boot_sequence(api, vcpus=template.vcpus, memory_mib=template.memory_mib,
                                    pids_max=template.pids_max, workdir_mib=template.workdir_mib)  # fmt: skip
            remaining = template.create_timeout_s - (time.perf_counter() - t0)
            conn = await vsock_connect(root / JAIL_VSOCK.lstrip("/"), AGENT_VSOCK_PORT, remaining,
                                       name=f"firecracker-{sandbox_id}")  # fmt: skip
            await conn.wait_hello(max(template.create_timeout_s - (time.perf_counter() - t0), 1.0))
        except BaseException as e:  # noqa: BLE001 - cleanup on anything (cancellation too), then re-raise
            console = root / JAIL_CONSOLE.lstrip("/")
            tail = console.read_text(errors="replace")[-1500:] if console.exists() else ""
            await _kill_and_clean(proc, jail_dir, cgroup_dirs)
            if self.journal is not None:
                self.journal.remove(sandbox_id)
            if not isinstance(e, OSError | FirecrackerAPIError | SandboxBroken):
                raise
            raise SandboxBroken(f"firecracker-{sandbox_id}: {e}; guest console: {tail!r}") from None
        boot_s = time.perf_counter() - t0
        self.boot_times_s.append(boot_s)
        sb = FirecrackerSandbox(sandbox_id, template, conn, proc=proc, jail_dir=jail_dir,
                                cgroup_dirs=cgroup_dirs, boot_s=boot_s, cpus=cpus, mems=mems,
                                journal=self.journal)  # fmt: skip
        if self.journal is not None:
            self.journal.write(sb.record())
        return sb


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)
    os.chmod(dst, 0o444)
