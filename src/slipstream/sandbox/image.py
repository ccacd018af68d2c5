"""Guest image for the microVM backends (QEMU `-M microvm`, Firecracker): a Debian cloud kernel plus
a gzip'd cpio (newc) initramfs holding busybox-static, a trimmed copy of the host's Debian Python
3 runtime, the kernel modules for virtio-mmio / virtio-console / vsock, and the guest agent.

`build_image()` is cached under `<cache>/images/<hash>/` where the hash covers every input (kernel
and module bytes, busybox, the Python binary and its libraries, the stdlib file list, the agent
source, the init scripts and this builder's version); a change of any input builds a new image.

Kernel source, in order: `$SLIPSTREAM_GUEST_KERNEL` (a bzImage whose modules lie in
`$SLIPSTREAM_GUEST_MODULES`), the host's `/boot/vmlinuz-*-cloud-amd64` when its
`/lib/modules/<version>` exists, else the Debian package `linux-image-<abi>-cloud-amd64` fetched
with `apt-get download` and unpacked with `dpkg -x` into the cache (nothing is installed on the
host). Not covered: non-x86_64 hosts, non-Debian hosts without those packages.
"""

from __future__ import annotations

import fcntl
import glob
import gzip
import hashlib
import io
import json
import logging
import os
import re
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from slipstream.rundir import private_dir

log = logging.getLogger(__name__)

BUILDER_VERSION = "2"
AGENT_SOURCE = Path(__file__).parent / "guest" / "agent.py"
GUEST_AGENT_PATH = "/opt/slipstream/agent.py"
GUEST_WORKDIR = "/sandbox"  # the agent's default workdir
# Kernel modules the guest loads at boot (with their dependencies, from modules.dep).
GUEST_MODULES = ("virtio_mmio", "virtio_console", "vmw_vsock_virtio_transport")
# Name of the virtio-serial port that carries the agent's frames (QEMU `virtserialport,name=`).
CONTROL_PORT_NAME = "org.slipstream.agent"
# Stdlib parts a sandboxed program never needs; leaving them out halves the image.
STDLIB_EXCLUDE_DIRS = {
    "test", "idlelib", "tkinter", "turtledemo", "ensurepip", "lib2to3", "pydoc_data",
    "distutils", "venv", "site-packages", "dist-packages", "__pycache__", "curses", "dbm",
}  # fmt: skip
DYNLOAD_EXCLUDE = re.compile(
    r"^(_test|xxlimited|_xx|_curses|readline|nis|ossaudiodev|_dbm|_gdbm|_ssl|_hashlib|_crypt|_tkinter)"
)

GUEST_UID = 1000  # the agent and every command run as this unprivileged user inside the guest
# Kernel command-line knobs the host sets (defaults here): slipstream.ctl=virtio|vsock:PORT,
# slipstream.pids_max=N (RLIMIT_NPROC of the sandbox user), slipstream.workdir_mib=N (tmpfs size).

# /init runs as PID 1: mounts, modules, hardening, then hands PID 1 to busybox init (which reaps
# orphans) with an inittab that starts the agent once and reboots when it exits. QEMU runs with
# -no-reboot and Firecracker exits on reboot, so a dead agent takes its VM down with it.
# Defence in depth inside the VM (the VM boundary is the isolation): commands run as uid
# {GUEST_UID}, with no_new_privs, RLIMIT_NPROC, /proc hidepid=invisible (no view of kernel threads or
# root processes), Yama ptrace_scope=3 (no ptrace at all), no user namespaces, no network device.
INIT_SCRIPT = f"""#!/bin/sh
export PATH=/usr/sbin:/usr/bin:/sbin:/bin PYTHONHOME=/usr PYTHONDONTWRITEBYTECODE=1 HOME=/root
mount -t proc -o hidepid=invisible proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
mkdir -p /dev/pts /dev/shm /run
ctl=virtio pids_max=256 workdir_mib=256
for arg in $(cat /proc/cmdline); do
  case "$arg" in
    slipstream.ctl=*) ctl="${{arg#slipstream.ctl=}}";;
    slipstream.pids_max=*) pids_max="${{arg#slipstream.pids_max=}}";;
    slipstream.workdir_mib=*) workdir_mib="${{arg#slipstream.workdir_mib=}}";;
  esac
done
echo "ctl=$ctl pids_max=$pids_max workdir_mib=$workdir_mib" > /run/slipstream.env
mount -t devpts devpts /dev/pts
mount -t tmpfs -o mode=1777,size=${{workdir_mib}}m tmpfs /tmp
mount -t tmpfs -o mode=1777,size=${{workdir_mib}}m tmpfs /dev/shm
mount -t tmpfs -o mode=0700,uid={GUEST_UID},gid={GUEST_UID},size=${{workdir_mib}}m tmpfs {GUEST_WORKDIR}
while read -r mod; do insmod "/lib/modules/$mod" || echo "init: insmod $mod failed"; done < /lib/modules/load-order
echo 3 > /proc/sys/kernel/yama/ptrace_scope
echo 0 > /proc/sys/user/max_user_namespaces
echo 1 > /proc/sys/kernel/dmesg_restrict
ip link set lo up 2>/dev/null
hostname sandbox
exec /sbin/init
"""
INITTAB = """::sysinit:/bin/true
::once:/sbin/slipstream-agent
::ctrlaltdel:/sbin/reboot -f
"""
# Starts the agent on the control channel, as the sandbox user, and reboots when it exits.
AGENT_RUN_SCRIPT = f"""#!/bin/sh
. /run/slipstream.env
cd {GUEST_WORKDIR}
case "$ctl" in
  vsock:*) chan="--vsock ${{ctl#vsock:}}";;
  *)
    dev=""
    for i in 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20; do
      for p in /sys/class/virtio-ports/*; do
        [ "$(cat "$p/name" 2>/dev/null)" = "{CONTROL_PORT_NAME}" ] && dev="/dev/${{p##*/}}"
      done
      [ -n "$dev" ] && [ -e "$dev" ] && break
      sleep 0.1
    done
    [ -n "$dev" ] || {{ echo "slipstream-agent: no virtio port {CONTROL_PORT_NAME}"; reboot -f; }}
    chown {GUEST_UID}:{GUEST_UID} "$dev"
    chan="--device $dev";;
esac
ulimit -u "$pids_max"
su -p -s /bin/sh sandbox -c "exec setpriv --nnp /usr/bin/python3 -S {GUEST_AGENT_PATH} --workdir {GUEST_WORKDIR} $chan"
echo "slipstream-agent: agent exited with status $?"
reboot -f
"""


@dataclass(frozen=True)
class ImagePaths:
    """A built guest image. `kernel` is the compressed bzImage (QEMU); Firecracker needs the ELF
    `vmlinux` that `firecracker.ensure_vmlinux()` extracts from it."""

    kernel: Path
    initramfs: Path
    manifest: Path

    @property
    def vmlinux(self) -> Path:
        return self.kernel.with_name("vmlinux")


def default_cache_dir() -> Path:
    root = os.environ.get("SLIPSTREAM_CACHE")
    return (Path(root) if root else Path.home() / ".cache" / "slipstream") / "images"


# ---------------------------------------------------------------------------------------- kernel


def _kernel_version(vmlinuz: Path) -> str:
    return vmlinuz.name.removeprefix("vmlinuz-")


def _version_key(version: str) -> list[int]:
    return [int(x) for x in re.findall(r"\d+", version)]


def _find_modules_dir(root: Path, version: str) -> Path | None:
    for base in (root / "lib" / "modules", root / "usr" / "lib" / "modules"):
        if (base / version / "modules.dep").is_file():
            return base / version
    return None


def _download_cloud_kernel(cache_root: Path) -> tuple[Path, Path]:
    """Fetches the Debian cloud kernel package into the cache (no host installation)."""
    if shutil.which("apt-get") is None or shutil.which("dpkg") is None:
        raise RuntimeError(
            "no guest kernel: /boot/vmlinuz-*-cloud-amd64 is absent and apt-get/dpkg are not available "
            "to fetch linux-image-cloud-amd64; set SLIPSTREAM_GUEST_KERNEL and SLIPSTREAM_GUEST_MODULES"
        )
    deps = subprocess.run(
        ["apt-cache", "depends", "linux-image-cloud-amd64"], capture_output=True, text=True
    )
    match = re.search(r"Depends: (linux-image-[0-9][^\s]*-cloud-amd64)\b", deps.stdout)
    if deps.returncode != 0 or match is None:
        raise RuntimeError(
            "cannot resolve linux-image-cloud-amd64 with apt-cache (run `apt-get update`?): "
            f"{deps.stderr.strip() or deps.stdout.strip()}"
        )
    package = match.group(1)
    unpack = cache_root / "kernel-pkg" / package
    if not (unpack / ".complete").exists():
        with tempfile.TemporaryDirectory(dir=cache_root) as tmp:
            log.warning("guest image: fetching %s with apt-get download (one-off)", package)
            done = subprocess.run(
                ["apt-get", "download", package], cwd=tmp, capture_output=True, text=True
            )
            debs = glob.glob(os.path.join(tmp, "*.deb"))
            if done.returncode != 0 or not debs:
                raise RuntimeError(f"apt-get download {package} failed: {done.stderr.strip()}")
            shutil.rmtree(unpack, ignore_errors=True)
            unpack.mkdir(parents=True)
            done = subprocess.run(
                ["dpkg", "-x", debs[0], str(unpack)], capture_output=True, text=True
            )
            if done.returncode != 0:
                raise RuntimeError(f"dpkg -x {debs[0]} failed: {done.stderr.strip()}")
            # modules.dep is written by depmod at install time, not shipped in the package.
            depmod = shutil.which("depmod") or "/sbin/depmod"
            for version_dir in (unpack / "lib" / "modules").glob("*"):
                done = subprocess.run([depmod, "-b", str(unpack), version_dir.name],
                                      capture_output=True, text=True)  # fmt: skip
                if done.returncode != 0:
                    raise RuntimeError(
                        f"depmod for {version_dir} failed (kmod installed?): {done.stderr}"
                    )
            (unpack / ".complete").touch()
    kernels = sorted((unpack / "boot").glob("vmlinuz-*"))
    if not kernels:
        raise RuntimeError(f"{package} unpacked into {unpack} holds no boot/vmlinuz-*")
    modules = _find_modules_dir(unpack, _kernel_version(kernels[-1]))
    if modules is None:
        raise RuntimeError(f"{package} unpacked into {unpack} holds no modules for {kernels[-1]}")
    return kernels[-1], modules


def find_kernel(cache_root: Path) -> tuple[Path, Path]:
    """(bzImage, modules dir) of the guest kernel; see the module docstring for the order."""
    env_kernel = os.environ.get("SLIPSTREAM_GUEST_KERNEL")
    if env_kernel:
        modules = os.environ.get("SLIPSTREAM_GUEST_MODULES", "")
        if not Path(env_kernel).is_file() or not (Path(modules) / "modules.dep").is_file():
            raise RuntimeError(
                f"SLIPSTREAM_GUEST_KERNEL={env_kernel!r} needs a readable file and "
                f"SLIPSTREAM_GUEST_MODULES={modules!r} a directory with modules.dep"
            )
        return Path(env_kernel), Path(modules)
    host = sorted(Path("/boot").glob("vmlinuz-*-cloud-amd64"), key=lambda p: _version_key(p.name))
    for vmlinuz in reversed(host):
        modules = _find_modules_dir(Path("/"), _kernel_version(vmlinuz))
        if modules is not None and os.access(vmlinuz, os.R_OK):
            return vmlinuz, modules
    return _download_cloud_kernel(cache_root)


def module_load_order(modules_dir: Path, wanted: tuple[str, ...] = GUEST_MODULES) -> list[str]:
    """Relative .ko paths for `wanted` and their dependencies, dependencies first; a module built
    into the kernel (modules.builtin) is skipped."""
    deps: dict[str, list[str]] = {}
    for line in (modules_dir / "modules.dep").read_text().splitlines():
        target, _, rest = line.partition(":")
        deps[target] = rest.split()
    by_name = {Path(p).name.split(".ko")[0].replace("-", "_"): p for p in deps}
    order: list[str] = []

    def visit(path: str) -> None:
        if path in order:
            return
        for dep in reversed(deps[path]):  # modules.dep lists the nearest dependency first
            visit(dep)
        order.append(path)

    for name in wanted:
        if name in by_name:
            visit(by_name[name])
        elif name not in (modules_dir / "modules.builtin").read_text():
            raise RuntimeError(f"kernel module {name} is neither in {modules_dir} nor built in")
    return order


# ---------------------------------------------------------------------------------------- python


def _guest_python() -> Path:
    """The Debian interpreter (not a venv or pyenv one): its libraries and stdlib are copied."""
    configured = os.environ.get("SLIPSTREAM_GUEST_PYTHON")
    candidate = Path(configured) if configured else Path("/usr/bin/python3")
    if not candidate.exists():
        raise RuntimeError(f"guest python {candidate} not found (set SLIPSTREAM_GUEST_PYTHON)")
    return candidate.resolve()


def _python_layout(python: Path) -> dict[str, str]:
    code = (
        "import json,sys,sysconfig,os;"
        "print(json.dumps({'stdlib':sysconfig.get_path('stdlib'),"
        "'dynload':os.path.join(sysconfig.get_path('platstdlib'),'lib-dynload'),"
        "'version':'%d.%d'%sys.version_info[:2],'prefix':sys.prefix}))"
    )
    out = subprocess.run([str(python), "-I", "-c", code], capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"guest python {python} does not run: {out.stderr.strip()[-300:]}")
    return json.loads(out.stdout)


def _shared_libs(binaries: list[Path]) -> set[Path]:
    libs: set[Path] = set()
    for binary in binaries:
        out = subprocess.run(["ldd", str(binary)], capture_output=True, text=True)
        for line in out.stdout.splitlines():
            m = re.search(r"(/\S+)\s+\(0x", line)
            if m:
                libs.add(Path(m.group(1)))
    return libs


# Runs under the guest interpreter (so the bytecode magic matches): zips the pure-Python stdlib with
# both sources (tracebacks show lines) and unchecked-hash .pyc files (PEP 552; zipimport then loads
# the bytecode without compiling, which matters under TCG where compiling site.py costs ~100 ms).
_ZIP_STDLIB = r"""
import importlib.util, importlib._bootstrap_external as bx, json, os, sys, zipfile
stdlib, out, guest_zip, exclude = sys.argv[1], sys.argv[2], sys.argv[3], set(json.loads(sys.argv[4]))
members = []
with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED, compresslevel=6) as zf:
    for dirpath, dirnames, filenames in os.walk(stdlib):
        rel_dir = os.path.relpath(dirpath, stdlib)
        dirnames[:] = sorted(d for d in dirnames if d not in exclude and d != "lib-dynload"
                             and not d.startswith("config-") and not d.startswith("site-"))
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            rel = os.path.normpath(os.path.join(rel_dir, name))
            with open(os.path.join(dirpath, name), "rb") as f:
                source = f.read()
            try:
                code = compile(source, guest_zip + "/" + rel, "exec", dont_inherit=True)
            except SyntaxError:
                continue  # a few lib2to3-style fixtures are not valid Python 3
            pyc = bx._code_to_hash_pyc(code, importlib.util.source_hash(source), checked=False)
            for member, data in ((rel, source), (rel + "c", bytes(pyc))):
                info = zipfile.ZipInfo(member, date_time=(2020, 1, 1, 0, 0, 0))
                info.compress_type = zipfile.ZIP_DEFLATED
                zf.writestr(info, data)
            members.append(rel)
print(json.dumps(members))
"""


def _stdlib_zip(python: Path, stdlib: Path, out: Path, guest_zip: str) -> list[str]:
    """Writes the stdlib zip to `out`; returns the module files it holds."""
    done = subprocess.run(
        [str(python), "-I", "-c", _ZIP_STDLIB, str(stdlib), str(out), guest_zip,
         json.dumps(sorted(STDLIB_EXCLUDE_DIRS))],
        capture_output=True, text=True,
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"zipping the stdlib of {python} failed: {done.stderr.strip()}")
    return json.loads(done.stdout)


# ------------------------------------------------------------------------------------------ cpio


class _Cpio:
    """Minimal cpio `newc` writer (what the kernel's initramfs unpacker reads); deterministic:
    uid/gid 0, mtime 0, so the same inputs give the same bytes."""

    def __init__(self) -> None:
        self.buf = io.BytesIO()
        self.ino = 1
        self.names: set[str] = set()

    def _entry(self, name: str, mode: int, data: bytes = b"") -> None:
        if name in self.names:
            return
        self.names.add(name)
        encoded = name.encode() + b"\0"
        fields = (self.ino, mode, 0, 0, 1, 0, len(data), 0, 0, 0, 0, len(encoded), 0)
        header = b"070701" + b"".join(b"%08X" % f for f in fields)
        self.buf.write(header + encoded)
        self.buf.write(b"\0" * (-(len(header) + len(encoded)) % 4))
        self.buf.write(data)
        self.buf.write(b"\0" * (-len(data) % 4))
        self.ino += 1

    def dir(self, name: str, mode: int = 0o755) -> None:
        parts = name.strip("/").split("/")
        for i in range(1, len(parts) + 1):
            self._entry("/".join(parts[:i]), 0o040000 | (mode if i == len(parts) else 0o755))

    def file(self, name: str, data: bytes, mode: int = 0o644) -> None:
        name = name.strip("/")
        if "/" in name:
            self.dir(name.rsplit("/", 1)[0])
        self._entry(name, 0o100000 | mode, data)

    def symlink(self, name: str, target: str) -> None:
        name = name.strip("/")
        if "/" in name:
            self.dir(name.rsplit("/", 1)[0])
        self._entry(name, 0o120777, target.encode())

    def finish(self) -> bytes:
        self._entry("TRAILER!!!", 0)
        return self.buf.getvalue()


# ----------------------------------------------------------------------------------------- build


def _busybox() -> Path:
    path = Path(shutil.which("busybox") or "/bin/busybox")
    if not path.exists():
        raise RuntimeError("busybox not found: install the Debian package busybox-static")
    out = subprocess.run(["ldd", str(path)], capture_output=True, text=True)
    if "not a dynamic executable" not in (out.stdout + out.stderr):
        raise RuntimeError(f"{path} is dynamically linked: install busybox-static, not busybox")
    return path


def _inputs(cache_root: Path) -> dict[str, object]:
    kernel, modules_dir = find_kernel(cache_root)
    python = _guest_python()
    layout = _python_layout(python)
    dynload = Path(layout["dynload"])
    dynload_mods = sorted(p for p in dynload.glob("*.so") if not DYNLOAD_EXCLUDE.match(p.name))
    if not AGENT_SOURCE.is_file():
        raise RuntimeError(f"guest agent {AGENT_SOURCE} is missing")
    return {
        "kernel": kernel,
        "modules_dir": modules_dir,
        "modules": module_load_order(modules_dir),
        "busybox": _busybox(),
        "python": python,
        "layout": layout,
        "dynload": dynload_mods,
        "libs": sorted(_shared_libs([python, *dynload_mods])),
    }


def _input_hash(inp: dict[str, object]) -> str:
    h = hashlib.sha256(f"builder={BUILDER_VERSION}\n".encode())
    for text in (INIT_SCRIPT, INITTAB, AGENT_RUN_SCRIPT, json.dumps(sorted(STDLIB_EXCLUDE_DIRS)),
                 DYNLOAD_EXCLUDE.pattern):  # fmt: skip
        h.update(text.encode())
    modules_dir: Path = inp["modules_dir"]  # type: ignore[assignment]
    files = [inp["kernel"], inp["busybox"], inp["python"], AGENT_SOURCE, *inp["dynload"],
             *inp["libs"], *(modules_dir / m for m in inp["modules"])]  # type: ignore[misc]  # fmt: skip
    for path in files:
        h.update(str(path).encode())
        h.update(hashlib.sha256(Path(path).read_bytes()).digest())
    # The stdlib is large: its file list with sizes and mtimes stands in for its bytes.
    stdlib = Path(inp["layout"]["stdlib"])  # type: ignore[index]
    for dirpath, _, filenames in sorted(os.walk(stdlib)):
        for name in sorted(filenames):
            if name.endswith(".py"):
                st = os.stat(os.path.join(dirpath, name))
                h.update(f"{dirpath}/{name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def _assemble(inp: dict[str, object], out_dir: Path) -> dict[str, object]:
    layout: dict[str, str] = inp["layout"]  # type: ignore[assignment]
    version = layout["version"]
    cpio = _Cpio()
    cpio.dir("root", 0o700)
    for d in ("proc", "sys", "dev", "tmp", "run", "etc", GUEST_WORKDIR, "usr/sbin"):
        cpio.dir(d)
    busybox: Path = inp["busybox"]  # type: ignore[assignment]
    cpio.file("bin/busybox", busybox.read_bytes(), 0o755)
    applets = subprocess.run(
        [str(busybox), "--list-full"], capture_output=True, text=True, check=True
    )
    for applet in applets.stdout.split():
        if applet not in ("sbin/init", "bin/sh", "linuxrc"):
            cpio.symlink(applet, "/bin/busybox")
    cpio.symlink("bin/sh", "/bin/busybox")
    cpio.symlink("sbin/init", "/bin/busybox")
    cpio.file("init", INIT_SCRIPT.encode(), 0o755)
    cpio.file("etc/inittab", INITTAB.encode())
    cpio.file("sbin/slipstream-agent", AGENT_RUN_SCRIPT.encode(), 0o755)
    cpio.file("etc/passwd", f"root:x:0:0:root:/root:/bin/sh\nsandbox:x:{GUEST_UID}:{GUEST_UID}::"
              f"{GUEST_WORKDIR}:/bin/sh\nnobody:x:65534:65534::/:/bin/false\n".encode())  # fmt: skip
    cpio.file("etc/group", f"root:x:0:\nsandbox:x:{GUEST_UID}:\nnogroup:x:65534:\n".encode())
    cpio.file("etc/hostname", b"sandbox\n")
    # Modules, flat, in load order.
    modules_dir: Path = inp["modules_dir"]  # type: ignore[assignment]
    order: list[str] = inp["modules"]  # type: ignore[assignment]
    for rel in order:
        cpio.file(f"lib/modules/{Path(rel).name}", (modules_dir / rel).read_bytes())
    cpio.file("lib/modules/load-order", "".join(Path(r).name + "\n" for r in order).encode())
    # Python: binary, shared libraries at their host paths, the zipped stdlib, extension modules.
    python: Path = inp["python"]  # type: ignore[assignment]
    cpio.file(f"usr/bin/python{version}", python.read_bytes(), 0o755)
    cpio.symlink("usr/bin/python3", f"python{version}")
    cpio.symlink("usr/bin/python", f"python{version}")
    for lib in inp["libs"]:  # type: ignore[attr-defined]
        cpio.file(str(lib), Path(lib).resolve().read_bytes(), 0o755)
    zip_name = f"python{version.replace('.', '')}.zip"
    guest_zip = f"/usr/lib/{zip_name}"
    zip_path = out_dir / zip_name
    members = _stdlib_zip(python, Path(layout["stdlib"]), zip_path, guest_zip)
    cpio.file(guest_zip, zip_path.read_bytes())
    zip_path.unlink()
    cpio.dir(f"usr/lib/python{version}")  # the landmark directory getpath looks for
    for so in inp["dynload"]:  # type: ignore[attr-defined]
        cpio.file(f"usr/lib/python{version}/lib-dynload/{Path(so).name}", Path(so).read_bytes())
    cpio.file(GUEST_AGENT_PATH, AGENT_SOURCE.read_bytes(), 0o755)
    raw = cpio.finish()
    with gzip.GzipFile(out_dir / "initramfs.cpio.gz", "wb", compresslevel=6, mtime=0) as gz:
        gz.write(raw)
    return {
        "uncompressed_bytes": len(raw),
        "stdlib_modules": len(members),
        "stdlib_zip": guest_zip,
        "kernel_modules": [Path(r).name for r in order],
        "extension_modules": [Path(p).name for p in inp["dynload"]],  # type: ignore[attr-defined]
        "shared_libs": [str(p) for p in inp["libs"]],  # type: ignore[attr-defined]
    }


def build_image(cache_dir: Path | str | None = None, force: bool = False) -> ImagePaths:
    """Builds (or finds in the cache) the guest image and returns its paths. Safe to call from
    several processes at once (a lock file serialises builds). Raises RuntimeError naming the
    missing input when a kernel, busybox-static or the guest Python cannot be found."""
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    # ours and not writable by others (rundir): a directory another user made first is refused;
    # 0o755 because unprivileged VMMs (the Firecracker jail uid) read the image
    private_dir(cache, mode=0o755)
    with open(cache / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        inp = _inputs(cache)
        digest = _input_hash(inp)
        final = cache / digest
        paths = ImagePaths(final / "vmlinuz", final / "initramfs.cpio.gz", final / "manifest.json")
        if paths.manifest.is_file() and not force:
            return paths
        t0 = time.perf_counter()
        tmp = Path(tempfile.mkdtemp(prefix=f".{digest}-", dir=cache))
        os.chmod(tmp, 0o755)  # readable by unprivileged VMMs (the Firecracker jail uid)
        try:
            shutil.copyfile(inp["kernel"], tmp / "vmlinuz")  # type: ignore[arg-type]
            contents = _assemble(inp, tmp)
            manifest = {
                "hash": digest,
                "builder_version": BUILDER_VERSION,
                "kernel_source": str(inp["kernel"]),
                "kernel_version": _kernel_version(Path(inp["kernel"])),  # type: ignore[arg-type]
                "busybox": str(inp["busybox"]),
                "python": str(inp["python"]),
                "python_version": inp["layout"]["version"],  # type: ignore[index]
                "agent_sha256": hashlib.sha256(AGENT_SOURCE.read_bytes()).hexdigest(),
                "kernel_bytes": (tmp / "vmlinuz").stat().st_size,
                "initramfs_bytes": (tmp / "initramfs.cpio.gz").stat().st_size,
                "build_s": round(time.perf_counter() - t0, 2),
                **contents,
            }
            (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
            shutil.rmtree(final, ignore_errors=True)
            os.rename(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        log.info("guest image %s built in %.1f s", final, manifest["build_s"])
        _prune(cache, keep=final)
        return paths


def _prune(cache: Path, keep: Path, num_kept: int = 3) -> None:
    """Old images (other inputs, e.g. an earlier agent) pile up at ~28 MB each: keep the newest
    few, in case a running process still boots from one of them."""
    images = sorted((d for d in cache.iterdir() if (d / "manifest.json").is_file() and d != keep),
                    key=lambda d: d.stat().st_mtime, reverse=True)  # fmt: skip
    for old in images[num_kept - 1 :]:
        shutil.rmtree(old, ignore_errors=True)
