"""Topology reader: cpulist parsing, the fake 2-NUMA/SMT/4-L3 sysfs fixture, and this host."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from slipstream.sandbox.host_topology import format_cpulist, parse_cpulist, read_topology

FIXTURE = Path(__file__).resolve().parents[1] / "data" / "sysfs_2numa_smt_4l3"


@pytest.mark.parametrize(
    ("text", "cpus"),
    [
        ("0-3,8", [0, 1, 2, 3, 8]),
        ("0", [0]),
        ("", []),
        ("\n", []),
        ("5,1-2,2\n", [1, 2, 5]),
        ("0-7:2", [0, 2, 4, 6]),
    ],
)
def test_parse_cpulist(text: str, cpus: list[int]) -> None:
    assert parse_cpulist(text) == cpus


@pytest.mark.parametrize("bad", ["a", "3-1", "1-x", "0-4:0", "-1"])
def test_parse_cpulist_rejects_bad_tokens(bad: str) -> None:
    with pytest.raises(ValueError, match="cpulist"):
        parse_cpulist(bad)


def test_format_cpulist_round_trip() -> None:
    assert format_cpulist([8, 0, 1, 2, 3]) == "0-3,8"
    assert format_cpulist([]) == ""
    assert format_cpulist({4}) == "4"
    assert format_cpulist((0, 2, 3, 4, 6)) == "0,2-4,6"
    for text in ["0-3,8", "1,3,5-9,12", "0-15"]:
        assert format_cpulist(parse_cpulist(text)) == text


def test_fixture_topology() -> None:
    topo = read_topology(FIXTURE)
    assert topo.online_cpus == tuple(range(16))
    assert topo.cores == tuple((c, c + 8) for c in range(8))
    assert topo.smt_active is True and topo.smt_source == "sysfs"
    assert topo.smt_control == "on"
    assert topo.threads_per_core == 2
    assert topo.packages == {0: (0, 1, 2, 3, 8, 9, 10, 11), 1: (4, 5, 6, 7, 12, 13, 14, 15)}
    assert sorted(topo.numa_nodes) == [0, 1]
    assert topo.numa_nodes[0] == ((0, 1, 2, 3, 8, 9, 10, 11), 16 * 1024**3)
    assert topo.numa_nodes[1][0] == (4, 5, 6, 7, 12, 13, 14, 15)
    assert topo.mem_total_bytes == 32 * 1024**3
    assert topo.l3_domains == ((0, 1, 8, 9), (2, 3, 10, 11), (4, 5, 12, 13), (6, 7, 14, 15))
    assert topo.node_of_cpu(13) == 1
    assert topo.notes == ()
    d = topo.to_dict()
    assert d["numa_nodes"]["1"]["cpus"] == "4-7,12-15"
    assert d["l3_domains"][0] == "0-1,8-9"


def test_missing_files_are_inferred_and_noted(tmp_path: Path) -> None:
    root = tmp_path / "sys"
    shutil.copytree(FIXTURE, root)
    shutil.rmtree(root / "devices/system/cpu/smt")
    shutil.rmtree(root / "devices/system/node")
    (root / "devices/system/cpu/online").write_text("0-3,8-11\n")  # take node 1 offline
    for cpu in range(16):
        (root / f"devices/system/cpu/cpu{cpu}/topology/thread_siblings_list").unlink()
    topo = read_topology(root)
    assert topo.online_cpus == (0, 1, 2, 3, 8, 9, 10, 11)
    # core_cpus_list is the fallback for siblings; offline siblings are dropped.
    assert topo.cores == ((0, 8), (1, 9), (2, 10), (3, 11))
    assert topo.smt_active is True and topo.smt_source == "inferred"
    assert list(topo.numa_nodes) == [0]
    assert topo.l3_domains == ((0, 1, 8, 9), (2, 3, 10, 11))
    joined = " ".join(topo.notes)
    assert "smt" in joined and "node" in joined


def test_missing_tree_fails_loudly(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="devices/system/cpu"):
        read_topology(tmp_path)


@pytest.mark.skipif(not Path("/sys/devices/system/cpu/online").exists(), reason="no sysfs")
def test_this_host() -> None:
    topo = read_topology()
    assert topo.num_cpus >= 1
    assert sum(len(c) for c in topo.cores) == topo.num_cpus
    affinity = os.sched_getaffinity(0)
    assert affinity <= set(topo.online_cpus)
    assert topo.mem_total_bytes > 0
    assert all(set(cpus) <= set(topo.online_cpus) for cpus, _ in topo.numa_nodes.values())
