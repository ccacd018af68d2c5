"""`slipstream sweep` config: the density sweep's matrix, workload, statistics and recommendation.

A standalone section (the sweep is an operator tool, not part of a training job): loaded by
`slipstream sweep run -c FILE` with dotted overrides (`--sweep.repeats=3`) or from flags.
Defaults are sized so that a bwrap sweep on a 2-vCPU machine finishes in well under 5 minutes.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from slipstream.config.base import Section

Backend = Literal["process", "bwrap", "qemu", "firecracker"]
Pinning = Literal["none", "core", "thread", "l3"]
MemoryPlacement = Literal["local", "interleave"]
Workload = Literal["cpu-loop", "verify", "build", "io", "episode"]
SmtMode = Literal["as-found", "on", "off"]


class SweepConfig(Section):
    backends: list[Backend] = Field(default_factory=lambda: ["bwrap"])
    """Sandbox backends to sweep (`slipstream sandbox doctor` says which work on this host)."""
    pinnings: list[Pinning] = Field(default_factory=lambda: ["none", "core"])
    """CPU pinning policies: `none`, `core` (one physical core, all its SMT threads, per sandbox,
    round-robin when sandboxes outnumber cores), `thread` (one hardware thread), `l3` (one L3 domain)."""
    memory_placements: list[MemoryPlacement] = Field(
        default_factory=lambda: ["local", "interleave"]
    )
    """NUMA memory placement: `local` (node of the pinned CPUs) or `interleave` (across all nodes).
    `interleave` needs >= 2 NUMA nodes; on one node it is reported as not honoured."""
    smt: list[SmtMode] = Field(default_factory=lambda: ["as-found"])
    """SMT state per configuration. `as-found` records it; `on`/`off` need a writable
    /sys/devices/system/cpu/smt/control (root, SMT-capable CPU), otherwise reported as not honoured."""
    densities: list[float] = Field(default_factory=lambda: [0.5, 1.0, 1.5, 2.0])
    """Sandboxes per online vCPU. The sandbox count is round(density x vCPUs), at least 1."""
    repeats: int = Field(default=2, ge=1)
    """Independent repeats of every (configuration, density) cell: fresh sandboxes each time."""
    iterations: int = Field(default=4, ge=1)
    """Minimum barrier-released workload runs per sandbox per repeat (one latency sample each)."""
    min_samples_per_cell: int = Field(default=160, ge=0)
    """Low densities get more iterations until a cell (all repeats) has at least this many samples:
    10 x G samples are needed to estimate the max of G (default 160 = 10 x 16)."""
    workload: Workload = "verify"
    """Built-in workload: cpu-loop (synthetic control), verify (small unittest suite), build
    (compile+link a C program, or byte-compile a package without gcc), io (small files and process
    creations), episode (N exec turns with think time)."""
    workload_cmd: str | None = None
    """Your own workload: a shell command run with `sh -c` in each sandbox (overrides `workload`)."""
    workload_scale: float = Field(default=1.0, gt=0)
    """Multiplies the built-in workload's size (loop count, files, tests)."""
    episode_turns: int = Field(default=4, ge=1)
    """`episode` workload: exec turns per episode."""
    episode_think_s: float = Field(default=0.05, ge=0)
    """`episode` workload: host-side think time between turns (stands in for generation)."""
    timeout_s: float = Field(default=30.0, gt=0)
    """Per-sample timeout. A timed-out sample is a failure and counts at this value in the
    failures-included statistics."""
    start_concurrency: int = Field(default=4, ge=1)
    """At most this many sandboxes are being created at once before each cell's barrier."""
    group_sizes: list[int] = Field(default_factory=lambda: [8, 16, 64])
    """GRPO group sizes G for the amplification factor E[max of G latencies] / p50."""
    recommend_g: int = Field(default=16, ge=1)
    """The G the recommendation uses (must be in `group_sizes`)."""
    tolerance: float = Field(default=0.10, ge=0)
    """Recommendation: highest density whose amplification at `recommend_g` stays within this
    fraction of the lowest-density cell's (and every density below it does too)."""
    bootstrap_resamples: int = Field(default=400, ge=10)
    """Bootstrap resamples for the amplification confidence interval (95%)."""
    seed: int = 0
    """RNG seed for the bootstrap; fixed so `slipstream sweep report` rebuilds identically."""
    noise_check_runs: int = Field(default=30, ge=0)
    """Idle-host noise check: times a fixed in-process loop this many times before the sweep."""
    sysfs_root: str = "/sys"
    """Where to read the topology (a fake tree plans for another host: `--dry-run` only)."""
    memory_mib: int = Field(default=256, ge=16)
    """Memory limit per sandbox."""

    @field_validator("densities")
    @classmethod
    def _positive_sorted(cls, v: list[float]) -> list[float]:
        if not v:
            raise ValueError("at least one density is needed")
        if any(d <= 0 for d in v):
            raise ValueError(f"densities must be > 0, got {v}")
        return sorted(set(v))

    @field_validator("backends", "pinnings", "memory_placements", "smt", "group_sizes")
    @classmethod
    def _non_empty_unique(cls, v: list) -> list:
        if not v:
            raise ValueError("must not be empty")
        return list(dict.fromkeys(v))

    @model_validator(mode="after")
    def _g_in_groups(self) -> SweepConfig:
        if any(g < 1 for g in self.group_sizes):
            raise ValueError(f"group_sizes must be >= 1, got {self.group_sizes}")
        if self.recommend_g not in self.group_sizes:
            raise ValueError(
                f"recommend_g={self.recommend_g} is not in group_sizes={self.group_sizes}"
            )
        return self
