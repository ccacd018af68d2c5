"""The QEMU command line of a slipstream microVM: a pure function of the image and the limits,
in a module of its own so that the KVM probe (kvm.py) and the backend (qemu.py) both build it
without importing each other.
"""

from __future__ import annotations

from pathlib import Path

from slipstream.sandbox.image import ImagePaths

QEMU_BINARY = "qemu-system-x86_64"
TCG_TB_CACHE_MIB = 64
# Kernel command line. quiet: the serial console is slow under TCG. mitigations=off: the guest is
# the isolation boundary's inner side; its own Spectre mitigations cost boot and exec time under
# TCG. random.trust_cpu=on + RDRAND (`-cpu max` / `host`): no wait for the entropy pool.
# cryptomgr.notests: the crypto self-tests cost ~0.3 CPU-s of a ~4 CPU-s TCG boot.
KERNEL_CMDLINE = (
    "console=ttyS0 quiet panic=-1 reboot=t mitigations=off tsc=reliable no_timer_check "
    "random.trust_cpu=on cryptomgr.notests"
)


def qemu_argv(
    image: ImagePaths,
    run_dir: Path,
    *,
    memory_mib: int,
    vcpus: int,
    accel: str,
    name: str,
    qemu_binary: str = QEMU_BINARY,
    pids_max: int = 256,
    workdir_mib: int = 256,
) -> list[str]:
    """The QEMU command line for one microVM (accel: "kvm" or "tcg"). `pids_max` and `workdir_mib`
    become the guest's RLIMIT_NPROC for the sandbox user and its tmpfs sizes (see image.py)."""
    accel_args = ["-accel", "kvm", "-cpu", "host"]
    cmdline = (f"{KERNEL_CMDLINE} slipstream.ctl=virtio slipstream.pids_max={pids_max} "
               f"slipstream.workdir_mib={workdir_mib}")  # fmt: skip
    if accel == "tcg":
        accel_args = ["-accel", f"tcg,tb-size={TCG_TB_CACHE_MIB}", "-cpu", "max"]
        # Under TCG the guest TSC runs at the host's rate; on a loaded host the kernel's PIT
        # calibration fails and boot hangs after "Marking TSC unstable". Telling it the rate skips that.
        khz = host_tsc_khz()
        if khz:
            cmdline += f" tsc_early_khz={khz}"
    return [
        qemu_binary,
        "-name", name,
        "-M", "microvm,x-option-roms=off,isa-serial=on,auto-kernel-cmdline=off",
        *accel_args,
        "-nodefaults", "-no-user-config", "-no-reboot", "-display", "none",
        "-sandbox", "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny",
        "-m", str(memory_mib),
        "-smp", str(vcpus),
        "-kernel", str(image.kernel),
        "-initrd", str(image.initramfs),
        "-append", cmdline,
        "-serial", f"file:{run_dir / 'console.log'}",
        "-device", "virtio-serial-device,max_ports=2",
        "-chardev", f"socket,id=ctl,path={run_dir / 'ctl.sock'}",
        "-device", "virtserialport,chardev=ctl,name=org.slipstream.agent",
    ]  # fmt: skip


def host_tsc_khz() -> int | None:
    """The host's TSC rate in kHz (sysfs where exposed, else /proc/cpuinfo's `cpu MHz`)."""
    try:
        return int(Path("/sys/devices/system/cpu/cpu0/tsc_freq_khz").read_text())
    except (OSError, ValueError):
        pass
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("cpu MHz"):
                return int(float(line.split(":")[1]) * 1000)
    except (OSError, ValueError, IndexError):
        pass
    return None
