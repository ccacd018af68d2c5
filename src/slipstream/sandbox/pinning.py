"""CPU and memory placement of sandboxes, allocated from the host `Topology` (host_topology.py).

Policies (`SandboxTemplate.pinning`), each exclusive — a CPU belongs to at most one live sandbox:
- `none`:   no CPU set (the sandbox may run anywhere its cgroup parent allows); no allocation.
- `thread`: `vcpus` logical CPUs, preferring SMT siblings of one core, then CPUs of one L3 domain.
- `core`:   whole physical cores, all SMT siblings included, enough cores to cover `vcpus`; no other
            sandbox shares those cores (the seed's "dedicate a physical core" pin).
- `l3`:     `vcpus` logical CPUs all inside one L3 domain, best fit (the fullest domain that still
            fits), so sandboxes pack into caches and leave whole domains free.

Memory placement (`memory_policy`) gives the cpuset.mems: `local` = the NUMA nodes of the chosen
CPUs, `interleave` = every node with memory. On a single-node host both are "not applicable" and
`mems_for` returns None (recorded in `PinningAllocator.notes`).

Only CPUs that are online *and* in this process's affinity mask are handed out. Not covered:
fractional/shared CPU allocation for max_density > 1 with exclusive policies (allocation then blocks
until CPUs free up), CPU hotplug after start.
"""

from __future__ import annotations

import os

from slipstream.sandbox.host_topology import Topology, format_cpulist


class NoCpusFree(Exception):
    """The policy cannot place another sandbox right now."""


class PinningAllocator:
    def __init__(
        self,
        topology: Topology,
        policy: str,
        memory_policy: str = "local",
        allowed_cpus: set[int] | None = None,
    ) -> None:
        if policy not in ("none", "core", "thread", "l3"):
            raise ValueError(f"unknown pinning policy {policy!r}")
        if memory_policy not in ("local", "interleave"):
            raise ValueError(f"unknown memory policy {memory_policy!r}")
        self.topology = topology
        self.policy = policy
        self.memory_policy = memory_policy
        allowed = set(os.sched_getaffinity(0)) if allowed_cpus is None else set(allowed_cpus)
        self.cpus = tuple(c for c in topology.online_cpus if c in allowed)
        self.cores = [tuple(c for c in core if c in allowed) for core in topology.cores]
        self.cores = [c for c in self.cores if c]
        self.l3 = [tuple(c for c in d if c in allowed) for d in topology.l3_domains] or [self.cpus]
        self.l3 = [d for d in self.l3 if d]
        self.used: set[int] = set()
        self.notes: list[str] = []
        if topology.num_numa_nodes <= 1:
            self.notes.append(
                f"memory_policy={memory_policy}: not applicable, one NUMA node (cpuset.mems untouched)"
            )

    @property
    def free(self) -> tuple[int, ...]:
        return tuple(c for c in self.cpus if c not in self.used)

    def capacity(self, vcpus: int) -> int | None:
        """How many sandboxes of `vcpus` fit when nothing is allocated (None = unlimited/none)."""
        if self.policy == "none":
            return None
        if self.policy == "core":
            per = self._cores_needed(vcpus)
            return len(self.cores) // per if per else 0
        if self.policy == "l3":
            return sum(len(d) // vcpus for d in self.l3)
        return len(self.cpus) // vcpus

    def _cores_needed(self, vcpus: int) -> int:
        sizes = sorted((len(c) for c in self.cores), reverse=True)
        total = 0
        for i, s in enumerate(sizes):
            total += s
            if total >= vcpus:
                return i + 1
        return 0

    def allocate(self, vcpus: int) -> tuple[int, ...] | None:
        """CPUs for one sandbox (None for policy none). Raises NoCpusFree."""
        if self.policy == "none":
            return None
        if self.policy == "core":
            chosen = self._alloc_cores(vcpus)
        elif self.policy == "l3":
            chosen = self._alloc_l3(vcpus)
        else:
            chosen = self._alloc_threads(vcpus)
        self.used.update(chosen)
        return tuple(sorted(chosen))

    def can_allocate(self, vcpus: int) -> bool:
        if self.policy == "none":
            return True
        try:
            cpus = self.allocate(vcpus)
        except NoCpusFree:
            return False
        self.release(cpus)
        return True

    def release(self, cpus: tuple[int, ...] | None) -> None:
        if cpus:
            self.used.difference_update(cpus)

    def _alloc_cores(self, vcpus: int) -> list[int]:
        free_cores = [c for c in self.cores if not any(x in self.used for x in c)]
        chosen: list[int] = []
        for core in free_cores:
            if len(chosen) >= vcpus:
                break
            chosen.extend(core)
        if len(chosen) < vcpus:
            raise NoCpusFree(
                f"pinning=core: {vcpus} vCPUs need whole free cores; free cores: "
                f"{[format_cpulist(c) for c in free_cores]}"
            )
        return chosen

    def _alloc_l3(self, vcpus: int) -> list[int]:
        fits = [
            [c for c in d if c not in self.used]
            for d in self.l3
            if sum(c not in self.used for c in d) >= vcpus
        ]
        if not fits:
            raise NoCpusFree(f"pinning=l3: no L3 domain has {vcpus} free CPUs")
        best = min(fits, key=len)  # best fit: pack the fullest domain first
        return self._prefer_siblings(best, vcpus)

    def _alloc_threads(self, vcpus: int) -> list[int]:
        free = self.free
        if len(free) < vcpus:
            raise NoCpusFree(f"pinning=thread: {vcpus} CPUs wanted, free: {format_cpulist(free)}")
        for d in sorted(self.l3, key=lambda d: sum(c not in self.used for c in d)):
            cand = [c for c in d if c not in self.used]
            if len(cand) >= vcpus:
                return self._prefer_siblings(cand, vcpus)
        return self._prefer_siblings(list(free), vcpus)

    def _prefer_siblings(self, cand: list[int], vcpus: int) -> list[int]:
        """Take CPUs from cores that are already partly used or whose siblings are all free."""
        cand_set = set(cand)
        ordered: list[int] = []
        partly = [c for c in self.cores if any(x in self.used for x in c)]
        for core in partly + [c for c in self.cores if c not in partly]:
            ordered.extend(x for x in core if x in cand_set and x not in ordered)
        ordered.extend(x for x in cand if x not in ordered)
        return ordered[:vcpus]

    def mems_for(self, cpus: tuple[int, ...] | None) -> tuple[int, ...] | None:
        """cpuset.mems for a sandbox on `cpus`; None where not applicable (one NUMA node)."""
        nodes = {n: c for n, (c, mem) in self.topology.numa_nodes.items() if mem > 0 or c}
        if len(nodes) <= 1:
            return None
        if self.memory_policy == "interleave" or not cpus:
            return tuple(sorted(n for n, (_, mem) in self.topology.numa_nodes.items() if mem > 0))
        local = {self.topology.node_of_cpu(c) for c in cpus} - {None}
        return tuple(sorted(n for n in local if n is not None))
