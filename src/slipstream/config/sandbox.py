"""`[sandbox]`: isolation backend, the shape of each sandbox, and the host agent's warm pool."""

from typing import Literal

from pydantic import Field

from slipstream.config.base import Section


class SandboxConfig(Section):
    backend: Literal["process", "bwrap", "qemu", "firecracker"] = "bwrap"
    """Isolation backend. `process` is for development only and isolates nothing."""
    image: str | None = None
    """Guest image directory for qemu/firecracker (default: the image `slipstream sandbox build-image` builds)."""
    vcpus: int = Field(default=1, ge=1)
    """vCPUs per sandbox (CPU quota, and the CPUs a pinning policy reserves)."""
    memory_mib: int = Field(default=512, ge=16, le=1 << 20)  # 1 TiB: cgroup limit / VM RAM
    """Memory limit per sandbox (cgroup memory + swap; the VM's RAM for VM backends)."""
    pinning: Literal["none", "core", "thread", "l3"] = "none"
    """CPU pinning policy: none, core (whole physical cores incl. SMT siblings, exclusive), thread (logical CPUs), l3 (pack within one L3 domain)."""
    memory_policy: Literal["local", "interleave"] = "local"
    """NUMA memory placement via cpuset.mems: local (nodes of the pinned CPUs) or interleave (all nodes). Not applicable on one-node hosts."""
    max_density: float = Field(default=1.0, gt=0)
    """Admission limit: live sandboxes <= online vCPUs x max_density (the seed's 1.0x rule)."""
    pids_max: int = Field(default=256, ge=8)
    """Process/thread limit per sandbox (cgroup pids controller)."""
    exec_timeout_s: float = Field(default=30.0, gt=0)
    """Default wall-clock timeout of one command; the command's whole process group is killed."""
    create_timeout_s: float = Field(default=60.0, gt=0)
    """How long creating a sandbox (until its guest agent says hello) may take."""
    output_cap_bytes: int = Field(default=1 << 20, ge=1024)
    """Per-stream cap on captured stdout/stderr; the rest is dropped and flagged as truncated."""
    workdir_mib: int = Field(default=256, ge=1, le=1 << 20)  # a tmpfs size, counted in memory
    """Size of the sandbox's private writable tmpfs (bwrap); counts against memory_mib."""
    min_idle: int = Field(default=2, ge=0)
    """Warm pool: keep at least this many idle sandboxes ready."""
    max_idle: int = Field(default=4, ge=0)
    """Warm pool: never keep more idle sandboxes than this."""
    create_concurrency: int = Field(default=2, ge=1)
    """Warm pool: at most this many sandboxes are being created at once."""
    reuse: bool = False
    """Return released sandboxes to the pool after a reset instead of destroying them (single use by default)."""
    acquire_timeout_s: float = Field(default=60.0, gt=0)
    """How long acquiring a sandbox may wait for admission before it fails."""
    memory_reserve_mib: int = Field(default=256, ge=0)
    """Admission: MemAvailable must exceed a new sandbox's memory_mib by this much."""
    state_dir: str | None = None
    """Journal of live sandboxes (crash recovery) and work dirs (default: /run/slipstream/sandbox for root, else $XDG_RUNTIME_DIR/slipstream/sandbox or ~/.cache/slipstream/run/sandbox); must be owned by this user and not writable by others."""
    verify_in_sandbox: Literal["auto", "always", "never"] = "auto"
    """RL rollout verification through a per-worker SandboxPool: auto (when the task set has a sandboxed verifier, i.e. it executes model output: `code`), always (fail if the task has none), never (the task's verifier in-process)."""
