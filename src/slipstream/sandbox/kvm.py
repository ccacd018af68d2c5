"""Does KVM work here? Decided by a real boot, not by the presence of /dev/kvm.

On nested hosts /dev/kvm often exists and opens, yet guests crash (QEMU aborts on an MSR write) or
hang in early boot. `probe_kvm()` boots the guest image once with `-accel kvm` and says yes only if
the guest agent sends its hello within a timeout. The answer is cached per host boot (keyed by
/proc/sys/kernel/random/boot_id, the QEMU binary and the kernel) in `<cache>/kvm-probe.json`.
`SLIPSTREAM_KVM=0|1` overrides the probe (1 = trust KVM without a test boot).

Not covered: KVM that boots but misbehaves later; Firecracker's own KVM checks (its probe is in
firecracker.py and reuses this answer).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import socket
import struct
import subprocess
import tempfile
import time
from pathlib import Path

from slipstream.sandbox.image import ImagePaths, default_cache_dir
from slipstream.sandbox.qemu_cmdline import qemu_argv

log = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 15.0  # a KVM microVM says hello in well under 2 s; TCG is not tried here


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return "unknown-boot"


def kvm_device_usable(dev: str = "/dev/kvm") -> tuple[bool, str]:
    """Cheap precondition: the device exists and we may open it read-write."""
    if not os.path.exists(dev):
        return False, f"{dev} does not exist (no hardware virtualisation exposed to this host)"
    if not os.access(dev, os.R_OK | os.W_OK):
        return False, f"{dev} is not readable and writable by uid {os.getuid()} (join group kvm)"
    return True, f"{dev} is accessible"


def probe_kvm(
    image: ImagePaths,
    *,
    qemu_binary: str = "qemu-system-x86_64",
    timeout_s: float = PROBE_TIMEOUT_S,
    cache_dir: Path | None = None,
    use_cache: bool = True,
) -> tuple[bool, str]:
    """(ok, reason): whether a KVM microVM boots to the agent's hello here. Blocking (up to
    `timeout_s` on a host where KVM guests hang); cached per host boot."""
    forced = os.environ.get("SLIPSTREAM_KVM")
    if forced in ("0", "1"):
        return forced == "1", f"SLIPSTREAM_KVM={forced} (probe skipped)"
    ok, reason = kvm_device_usable()
    if not ok:
        return ok, reason
    qemu = shutil.which(qemu_binary)
    if qemu is None:
        return False, f"{qemu_binary} not found"
    st = os.stat(qemu)
    key = hashlib.sha256(
        f"{_boot_id()}|{qemu}|{st.st_size}|{st.st_mtime_ns}|{image.kernel}".encode()
    ).hexdigest()[:16]
    cache_file = (cache_dir or default_cache_dir()) / "kvm-probe.json"
    if use_cache:
        try:
            cached = json.loads(cache_file.read_text())
            if cached.get("key") == key:
                return bool(cached["ok"]), str(cached["reason"])
        except (OSError, ValueError, KeyError):
            pass
    ok, reason = _test_boot(image, qemu_binary, timeout_s)
    log.info("KVM probe: ok=%s (%s)", ok, reason)
    try:
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache_file.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"key": key, "ok": ok, "reason": reason}))
        os.replace(tmp, cache_file)
    except OSError as e:
        log.warning("cannot cache the KVM probe result in %s: %s", cache_file, e)
    return ok, reason


def _test_boot(image: ImagePaths, qemu_binary: str, timeout_s: float) -> tuple[bool, str]:
    """Blocking on purpose (plain subprocess + socket): callers may sit in a thread of a running
    event loop, and a nested loop's child watcher would race the outer one for the exit status."""

    run_dir = Path(tempfile.mkdtemp(prefix="slipstream-kvm-probe-"))
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    proc = None
    t0 = time.perf_counter()
    try:
        listener.bind(str(run_dir / "ctl.sock"))
        listener.listen(1)
        argv = qemu_argv(image, run_dir, memory_mib=256, vcpus=1, accel="kvm",
                         name="slipstream-kvm-probe", qemu_binary=qemu_binary)  # fmt: skip
        with open(run_dir / "qemu.log", "wb") as qemu_log:
            proc = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=qemu_log, stderr=qemu_log
            )
        # wait for the guest's connection, but not for a QEMU that already exited (a host whose
        # KVM refuses the guest's MSRs aborts in ~0.1 s: the probe used to sit out timeout_s)
        listener.settimeout(0.1)
        while True:
            try:
                conn, _ = listener.accept()
                break
            except TimeoutError:
                if proc.poll() is not None:
                    raise ConnectionError("QEMU exited before the guest connected") from None
                if time.perf_counter() - t0 > timeout_s:
                    raise
        with conn:
            conn.settimeout(max(timeout_s - (time.perf_counter() - t0), 0.1))
            header = conn.recv(4, socket.MSG_WAITALL)
            if len(header) < 4:
                raise ConnectionError("control channel closed before hello")
            (length,) = struct.unpack(">I", header)
            body = json.loads(conn.recv(min(length, 1 << 16), socket.MSG_WAITALL))
        if body.get("type") != "hello":
            return False, f"a KVM test boot sent {body!r:.100} instead of hello"
        return True, f"a KVM test boot reached the guest agent in {time.perf_counter() - t0:.2f} s"
    except (OSError, ValueError) as e:  # socket.timeout is an OSError
        if proc is not None and proc.poll() is None:
            proc.kill()
        if proc is not None:
            proc.wait()
        lines = (run_dir / "qemu.log").read_text(errors="replace").strip().splitlines()
        if proc is not None and proc.returncode not in (None, -9):
            first = lines[0] if lines else "no message"
            return False, (f"a KVM test boot failed after {time.perf_counter() - t0:.1f} s: "
                           f"QEMU exited with {proc.returncode}: {first}")  # fmt: skip
        why = f"the guest hung ({type(e).__name__}: {e})"
        return False, f"a KVM test boot did not reach the guest agent within {timeout_s} s: {why}"
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        listener.close()
        shutil.rmtree(run_dir, ignore_errors=True)
