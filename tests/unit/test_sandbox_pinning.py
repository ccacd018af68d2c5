"""Pinning policies on fake topologies (SMT, several L3 domains, two NUMA nodes)."""

from __future__ import annotations

import pytest

from slipstream.sandbox.host_topology import Topology
from slipstream.sandbox.pinning import NoCpusFree, PinningAllocator


def topo(smt: bool = True) -> Topology:
    # 8 logical CPUs: cores (0,4) (1,5) (2,6) (3,7) with SMT; L3 domains {0,1,4,5} and {2,3,6,7};
    # NUMA node 0 = first L3, node 1 = second.
    cores = ((0, 4), (1, 5), (2, 6), (3, 7)) if smt else tuple((c,) for c in range(8))
    return Topology(
        online_cpus=tuple(range(8)),
        cores=cores,
        smt_active=smt,
        smt_source="sysfs",
        smt_control=None,
        packages={0: tuple(range(8))},
        numa_nodes={0: ((0, 1, 4, 5), 1 << 30), 1: ((2, 3, 6, 7), 1 << 30)},
        l3_domains=((0, 1, 4, 5), (2, 3, 6, 7)),
        sysfs_root="fake",
    )


def alloc(policy: str, memory_policy: str = "local") -> PinningAllocator:
    return PinningAllocator(topo(), policy, memory_policy, allowed_cpus=set(range(8)))


def test_none_allocates_nothing():
    a = alloc("none")
    assert a.allocate(4) is None and a.capacity(1) is None and a.can_allocate(100)


def test_core_takes_whole_cores_exclusively():
    a = alloc("core")
    first = a.allocate(1)
    assert first == (0, 4)  # one vCPU still gets the whole core, SMT sibling included
    second = a.allocate(2)
    assert second == (1, 5)
    third = a.allocate(3)  # needs two cores
    assert third == (2, 3, 6, 7)
    with pytest.raises(NoCpusFree, match="pinning=core"):
        a.allocate(1)
    a.release(second)
    assert a.allocate(1) == (1, 5)
    assert a.capacity(1) == 4 and a.capacity(3) == 2


def test_thread_takes_single_cpus_siblings_first():
    a = alloc("thread")
    got = [a.allocate(1) for _ in range(8)]
    assert sorted(c for t in got for c in t) == list(range(8))
    assert got[0] == (0,) and got[1] == (4,)  # the sibling of a partly used core comes next
    assert not a.can_allocate(1)


def test_l3_packs_within_one_domain_best_fit():
    a = alloc("l3")
    x = a.allocate(3)
    assert set(x) <= {0, 1, 4, 5}
    y = a.allocate(2)  # only 1 CPU left in the first domain: goes to the second
    assert set(y) <= {2, 3, 6, 7}
    z = a.allocate(1)  # best fit: the fullest domain that still fits (the first, 1 free)
    assert set(z) <= {0, 1, 4, 5}
    with pytest.raises(NoCpusFree, match="L3"):
        a.allocate(3)


def test_memory_placement():
    a = alloc("core", "local")
    assert a.mems_for((2, 6)) == (1,)
    assert a.mems_for((0, 2)) == (0, 1)
    assert alloc("core", "interleave").mems_for((2, 6)) == (0, 1)
    one_node = Topology(
        online_cpus=(0, 1),
        cores=((0,), (1,)),
        smt_active=False,
        smt_source="sysfs",
        smt_control=None,
        packages={0: (0, 1)},
        numa_nodes={0: ((0, 1), 1 << 30)},
        l3_domains=((0, 1),),
        sysfs_root="fake",
    )
    b = PinningAllocator(one_node, "thread", "interleave", allowed_cpus={0, 1})
    assert b.mems_for((0,)) is None
    assert any("not applicable" in n for n in b.notes)


def test_only_allowed_cpus_are_used():
    a = PinningAllocator(topo(), "thread", allowed_cpus={2, 3})
    assert {a.allocate(1)[0], a.allocate(1)[0]} == {2, 3}
    assert not a.can_allocate(1)


def test_bad_policy_named():
    with pytest.raises(ValueError, match="'numa'"):
        PinningAllocator(topo(), "numa")
