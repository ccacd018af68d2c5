"""Host CPU/memory topology read from sysfs (stdlib only).

`read_topology(sysfs_root)` reads a Linux sysfs tree (the real `/sys` or a fake directory tree laid
out the same way, used by tests) and returns a `Topology`: online CPUs, physical cores as tuples of
SMT sibling CPUs, whether SMT is active, packages, NUMA nodes with their CPUs and memory, and L3
cache domains. Pinning (sandbox layer) and the density sweep (planning, provenance) both use it.

Not covered: offline CPUs (ignored everywhere), cgroup cpuset restrictions of the calling process
(see `os.sched_getaffinity`), CPU frequency, caches other than L3, hybrid core types.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from pathlib import Path

__all__ = [
    "Topology",
    "format_cpulist",
    "parse_cpulist",
    "read_topology",
]

log = logging.getLogger(__name__)

_CPU_DIR_RE = re.compile(r"^cpu(\d+)$")
_NODE_DIR_RE = re.compile(r"^node(\d+)$")
_MEMTOTAL_RE = re.compile(r"MemTotal:\s+(\d+)\s*kB")


def parse_cpulist(text: str) -> list[int]:
    """Parse a kernel cpulist ("0-3,8,10-11", "" or "\\n") into a sorted list of unique ints.

    Also accepts strided ranges ("0-7:2"), which the kernel documents for cpuset syntax.
    Raises ValueError naming the bad token.
    """
    cpus: set[int] = set()
    for raw in text.strip().split(","):
        token = raw.strip()
        if not token:
            continue
        stride = 1
        if ":" in token:
            token, stride_text = token.split(":", 1)
            stride = int(stride_text)
            if stride < 1:
                raise ValueError(f"bad cpulist stride in {raw!r} (from {text!r})")
        try:
            if "-" in token:
                lo_text, hi_text = token.split("-", 1)
                lo, hi = int(lo_text), int(hi_text)
            else:
                lo = hi = int(token)
        except ValueError as exc:
            raise ValueError(f"bad cpulist token {raw!r} in {text!r}") from exc
        if lo < 0 or hi < lo:
            raise ValueError(f"bad cpulist range {raw!r} in {text!r}")
        cpus.update(range(lo, hi + 1, stride))
    return sorted(cpus)


def format_cpulist(cpus: list[int] | tuple[int, ...] | set[int] | frozenset[int]) -> str:
    """Format CPUs as the kernel does: sorted, runs collapsed ("0-3,8"). Empty -> ""."""
    ordered = sorted(set(cpus))
    parts: list[str] = []
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        parts.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(parts)


@dataclass(frozen=True)
class Topology:
    """Snapshot of the host topology. All CPU ids are logical CPU numbers, sorted.

    `cores`: one tuple of SMT sibling CPUs per physical core (online siblings only).
    `numa_nodes`: {node_id: (cpus, mem_total_bytes)}; a memory-only node has an empty cpu tuple.
    `l3_domains`: one tuple of CPUs per distinct L3 cache (empty if the tree has no L3 info).
    `smt_source`: "sysfs" if read from devices/system/cpu/smt/active, "inferred" otherwise.
    `notes`: what was missing or inferred (recorded in provenance, never silent).
    """

    online_cpus: tuple[int, ...]
    cores: tuple[tuple[int, ...], ...]
    smt_active: bool
    smt_source: str
    smt_control: str | None
    packages: dict[int, tuple[int, ...]]
    numa_nodes: dict[int, tuple[tuple[int, ...], int]]
    l3_domains: tuple[tuple[int, ...], ...]
    sysfs_root: str
    notes: tuple[str, ...] = field(default=())

    @property
    def num_cpus(self) -> int:
        return len(self.online_cpus)

    @property
    def num_cores(self) -> int:
        return len(self.cores)

    @property
    def threads_per_core(self) -> int:
        return max((len(c) for c in self.cores), default=1)

    @property
    def num_numa_nodes(self) -> int:
        return len(self.numa_nodes)

    @property
    def mem_total_bytes(self) -> int:
        return sum(mem for _, mem in self.numa_nodes.values())

    def node_of_cpu(self, cpu: int) -> int | None:
        for node, (cpus, _) in self.numa_nodes.items():
            if cpu in cpus:
                return node
        return None

    def to_dict(self) -> dict:
        """JSON-friendly form (cpulists as kernel strings, keys as str) for provenance."""
        return {
            "sysfs_root": self.sysfs_root,
            "online_cpus": format_cpulist(self.online_cpus),
            "num_cpus": self.num_cpus,
            "num_cores": self.num_cores,
            "threads_per_core": self.threads_per_core,
            "cores": [format_cpulist(c) for c in self.cores],
            "smt_active": self.smt_active,
            "smt_source": self.smt_source,
            "smt_control": self.smt_control,
            "packages": {str(k): format_cpulist(v) for k, v in sorted(self.packages.items())},
            "numa_nodes": {
                str(k): {"cpus": format_cpulist(c), "mem_total_bytes": m}
                for k, (c, m) in sorted(self.numa_nodes.items())
            },
            "l3_domains": [format_cpulist(d) for d in self.l3_domains],
            "notes": list(self.notes),
        }


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except (FileNotFoundError, NotADirectoryError, PermissionError):
        return None


def _cpu_ids(cpu_dir: Path) -> list[int]:
    if not cpu_dir.is_dir():
        return []
    ids = []
    for entry in cpu_dir.iterdir():
        m = _CPU_DIR_RE.match(entry.name)
        if m and entry.is_dir():
            ids.append(int(m.group(1)))
    return sorted(ids)


def _read_cores(cpu_dir: Path, online: list[int], notes: list[str]) -> list[tuple[int, ...]]:
    online_set = set(online)
    cores: set[tuple[int, ...]] = set()
    missing = []
    for cpu in online:
        topo = cpu_dir / f"cpu{cpu}" / "topology"
        text = _read(topo / "thread_siblings_list")
        if text is None:
            text = _read(topo / "core_cpus_list")
        if text is None:
            missing.append(cpu)
            cores.add((cpu,))
            continue
        sibs = tuple(c for c in parse_cpulist(text) if c in online_set) or (cpu,)
        cores.add(sibs)
    if missing:
        notes.append(
            f"no thread_siblings_list/core_cpus_list for cpus {format_cpulist(missing)}; "
            "each treated as its own core"
        )
    return sorted(cores)


def _read_packages(cpu_dir: Path, online: list[int], notes: list[str]) -> dict[int, tuple]:
    packages: dict[int, list[int]] = {}
    missing = []
    for cpu in online:
        text = _read(cpu_dir / f"cpu{cpu}" / "topology" / "physical_package_id")
        if text is None:
            missing.append(cpu)
            pkg = 0
        else:
            pkg = int(text.strip())
        packages.setdefault(pkg, []).append(cpu)
    if missing:
        notes.append(
            f"no physical_package_id for cpus {format_cpulist(missing)}; assumed package 0"
        )
    return {k: tuple(sorted(v)) for k, v in sorted(packages.items())}


def _read_numa(root: Path, online: list[int], notes: list[str]) -> dict[int, tuple]:
    node_dir = root / "devices" / "system" / "node"
    nodes: dict[int, tuple[tuple[int, ...], int]] = {}
    if node_dir.is_dir():
        online_set = set(online)
        for entry in sorted(node_dir.iterdir(), key=lambda p: p.name):
            m = _NODE_DIR_RE.match(entry.name)
            if not m:
                continue
            node = int(m.group(1))
            cpus = tuple(
                c for c in parse_cpulist(_read(entry / "cpulist") or "") if c in online_set
            )
            meminfo = _read(entry / "meminfo") or ""
            mm = _MEMTOTAL_RE.search(meminfo)
            if mm is None:
                notes.append(f"node{node}: no MemTotal in meminfo; memory recorded as 0")
            nodes[node] = (cpus, int(mm.group(1)) * 1024 if mm else 0)
    if not nodes:
        mem = 0
        text = _read(root.parent / "proc" / "meminfo") if root == Path("/sys") else None
        if text and (mm := _MEMTOTAL_RE.search(text)):
            mem = int(mm.group(1)) * 1024
        notes.append("no devices/system/node tree; all cpus assumed on node 0")
        nodes[0] = (tuple(online), mem)
    return dict(sorted(nodes.items()))


def _read_l3(cpu_dir: Path, online: list[int], notes: list[str]) -> list[tuple[int, ...]]:
    online_set = set(online)
    domains: set[tuple[int, ...]] = set()
    without = []
    for cpu in online:
        cache_dir = cpu_dir / f"cpu{cpu}" / "cache"
        found = False
        if cache_dir.is_dir():
            for index in sorted(cache_dir.glob("index*")):
                if (_read(index / "level") or "").strip() != "3":
                    continue
                shared = _read(index / "shared_cpu_list")
                if shared is None:
                    continue
                dom = tuple(c for c in parse_cpulist(shared) if c in online_set) or (cpu,)
                domains.add(dom)
                found = True
                break
        if not found:
            without.append(cpu)
    if without:
        notes.append(f"no L3 cache info for cpus {format_cpulist(without)}")
    return sorted(domains)


def read_topology(sysfs_root: str | Path = "/sys") -> Topology:
    """Read the topology under `sysfs_root` (a real or fake sysfs tree).

    Raises FileNotFoundError if the tree has no devices/system/cpu directory.
    Online CPUs come from cpu/online; if absent, every cpuN directory is taken as online (noted).
    """
    root = Path(sysfs_root)
    cpu_dir = root / "devices" / "system" / "cpu"
    if not cpu_dir.is_dir():
        raise FileNotFoundError(f"no CPU topology under {cpu_dir} (sysfs_root={sysfs_root!s})")
    notes: list[str] = []

    online_text = _read(cpu_dir / "online")
    if online_text is not None:
        online = parse_cpulist(online_text)
    else:
        online = _cpu_ids(cpu_dir)
        notes.append("no cpu/online file; every cpuN directory taken as online")
    if not online:
        raise ValueError(f"no online CPUs found under {cpu_dir}")

    cores = _read_cores(cpu_dir, online, notes)
    smt_control_text = _read(cpu_dir / "smt" / "control")
    smt_control = smt_control_text.strip() if smt_control_text is not None else None
    smt_text = _read(cpu_dir / "smt" / "active")
    if smt_text is not None:
        smt_active = smt_text.strip() == "1"
        smt_source = "sysfs"
    else:
        smt_active = any(len(c) > 1 for c in cores)
        smt_source = "inferred"
        notes.append("no cpu/smt/active; SMT inferred from sibling lists")

    return Topology(
        online_cpus=tuple(online),
        cores=tuple(cores),
        smt_active=smt_active,
        smt_source=smt_source,
        smt_control=smt_control,
        packages=_read_packages(cpu_dir, online, notes),
        numa_nodes=_read_numa(root, online, notes),
        l3_domains=tuple(_read_l3(cpu_dir, online, notes)),
        sysfs_root=str(root),
        notes=tuple(notes),
    )
