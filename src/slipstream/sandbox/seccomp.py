"""A classic-BPF seccomp filter for bwrap's `--seccomp FD`, assembled with `struct` (no libseccomp).

Policy (deny-list on top of namespaces + dropped capabilities): syscalls that attack the kernel or
escape the sandbox's namespaces return EPERM; `clone` with any CLONE_NEW* flag returns EPERM;
`clone3` returns ENOSYS (its flags live in memory a filter cannot read, and libc then falls back to
`clone`); a foreign architecture or the x32 ABI is refused outright (kill / EPERM).

Not covered: architectures other than x86_64 (`build_filter` raises), argument filtering beyond
clone flags, an allow-list policy (kept a deny-list so ordinary programs — compilers, Python, shells —
run unmodified).
"""

from __future__ import annotations

import errno
import os
import platform
import struct

# BPF opcodes (linux/filter.h) and seccomp return values (linux/seccomp.h).
BPF_LD_W_ABS = 0x20
BPF_JEQ_K = 0x15
BPF_JGE_K = 0x35
BPF_JSET_K = 0x45
BPF_RET_K = 0x06
SECCOMP_RET_KILL_PROCESS = 0x80000000
SECCOMP_RET_ERRNO = 0x00050000
SECCOMP_RET_ALLOW = 0x7FFF0000
AUDIT_ARCH_X86_64 = 0xC000003E
X32_SYSCALL_BIT = 0x40000000
# struct seccomp_data offsets: nr (int), arch (u32), instruction_pointer (u64), args[6] (u64)
OFF_NR, OFF_ARCH, OFF_ARG0_LO = 0, 4, 16
CLONE_NEW_FLAGS = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000
CLONE_NEW_FLAGS |= 0x40000000 | 0x00000080  # NEWNET, NEWTIME

# x86_64 syscall numbers (asm/unistd_64.h) that return EPERM inside sandboxes.
BLOCKED_X86_64 = {
    "ptrace": 101,
    "syslog": 103,
    "uselib": 134,
    "pivot_root": 155,
    "_sysctl": 156,
    "adjtimex": 159,
    "chroot": 161,
    "acct": 163,
    "settimeofday": 164,
    "mount": 165,
    "umount2": 166,
    "swapon": 167,
    "swapoff": 168,
    "reboot": 169,
    "sethostname": 170,
    "setdomainname": 171,
    "iopl": 172,
    "ioperm": 173,
    "create_module": 174,
    "init_module": 175,
    "delete_module": 176,
    "get_kernel_syms": 177,
    "query_module": 178,
    "quotactl": 179,
    "nfsservctl": 180,
    "lookup_dcookie": 212,
    "clock_settime": 227,
    "kexec_load": 246,
    "add_key": 248,
    "request_key": 249,
    "keyctl": 250,
    "unshare": 272,
    "perf_event_open": 298,
    "name_to_handle_at": 303,
    "open_by_handle_at": 304,
    "setns": 308,
    "process_vm_readv": 310,
    "process_vm_writev": 311,
    "kcmp": 312,
    "finit_module": 313,
    "kexec_file_load": 320,
    "bpf": 321,
    "userfaultfd": 323,
    "io_uring_setup": 425,
    "open_tree": 428,
    "move_mount": 429,
    "fsopen": 430,
    "fsconfig": 431,
    "fsmount": 432,
    "fspick": 433,
    "mount_setattr": 442,
}
NR_CLONE_X86_64 = 56
NR_CLONE3_X86_64 = 435


def _insn(code: int, k: int, jt: int = 0, jf: int = 0) -> tuple[int, int, int, int]:
    return (code, jt, jf, k)


def build_filter(machine: str | None = None) -> bytes:
    """The filter as raw `struct sock_filter[]` bytes (what bwrap reads from --seccomp FD)."""
    machine = machine or platform.machine()
    if machine != "x86_64":
        raise NotImplementedError(f"no seccomp filter for architecture {machine!r} (x86_64 only)")
    blocked = sorted(BLOCKED_X86_64.values())
    # Layout: [arch check][nr checks...][ALLOW][clone arg check][EPERM][ENOSYS]
    n_head = 5  # ld arch, jeq arch, kill, ld nr, jge x32
    n_checks = len(blocked) + 2  # + clone, clone3
    allow_at = n_head + n_checks
    clone_at = allow_at + 1  # ld arg0, jset, ret allow
    eperm_at = clone_at + 3
    enosys_at = eperm_at + 1
    prog: list[tuple[int, int, int, int]] = [
        _insn(BPF_LD_W_ABS, OFF_ARCH),
        _insn(BPF_JEQ_K, AUDIT_ARCH_X86_64, jt=1, jf=0),
        _insn(BPF_RET_K, SECCOMP_RET_KILL_PROCESS),
        _insn(BPF_LD_W_ABS, OFF_NR),
    ]
    i = len(prog)
    prog.append(_insn(BPF_JGE_K, X32_SYSCALL_BIT, jt=eperm_at - i - 1, jf=0))
    for nr, target in [(NR_CLONE_X86_64, clone_at), (NR_CLONE3_X86_64, enosys_at)] + [
        (nr, eperm_at) for nr in blocked
    ]:
        i = len(prog)
        prog.append(_insn(BPF_JEQ_K, nr, jt=target - i - 1, jf=0))
    assert len(prog) == allow_at
    prog.append(_insn(BPF_RET_K, SECCOMP_RET_ALLOW))
    prog.append(_insn(BPF_LD_W_ABS, OFF_ARG0_LO))
    i = len(prog)
    prog.append(_insn(BPF_JSET_K, CLONE_NEW_FLAGS, jt=eperm_at - i - 1, jf=0))
    prog.append(_insn(BPF_RET_K, SECCOMP_RET_ALLOW))
    assert len(prog) == eperm_at
    prog.append(_insn(BPF_RET_K, SECCOMP_RET_ERRNO | errno.EPERM))
    prog.append(_insn(BPF_RET_K, SECCOMP_RET_ERRNO | errno.ENOSYS))
    for code, jt, jf, _ in prog:
        if not (0 <= jt < 256 and 0 <= jf < 256):
            raise AssertionError(f"BPF jump out of range in instruction {code:#x}")
    return b"".join(struct.pack("=HBBI", *insn) for insn in prog)


def filter_fd(program: bytes) -> int:
    """A readable fd positioned at the start of `program` (a memfd); the caller closes it."""
    fd = os.memfd_create("slipstream-seccomp", os.MFD_CLOEXEC)
    os.write(fd, program)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd
