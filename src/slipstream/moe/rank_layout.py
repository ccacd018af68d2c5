"""Expert-parallel rank layout: `num_nodes x ranks_per_node` ranks, experts sharded contiguously.

Rank r sits on node r // ranks_per_node at local index r % ranks_per_node and owns the experts
[r * E_r, (r + 1) * E_r) with E_r = num_experts / world_size; node m therefore owns the contiguous
block of E / num_nodes experts that the cost model assumes.

On one machine "nodes" are simulated: a node is just a group of `ranks_per_node` consecutive
ranks. Bytes between ranks of the same simulated node are metered as intra-node (NVLink on a real
cluster), bytes between groups as inter-node (EFA/RDMA on a real cluster); on the CPU here both go
over the same loopback gloo transport, so only the byte counts, not the timings, say anything about
the real links.

Process groups: `world` (all ranks), `node_group` (the ranks of my node) and `rail_group` (the
ranks with my local index on every node - the peers a node-aware dispatcher uses for the single
inter-node hop, as DeepEP normal kernels do). `EPGroup.create` makes them; every rank must call it
with the same arguments, in the same order relative to other `new_group` calls.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Topology:
    """Pure layout arithmetic (no process groups): usable in tests and cost models."""

    num_nodes: int
    ranks_per_node: int
    num_experts: int

    def __post_init__(self) -> None:
        if self.num_nodes < 1 or self.ranks_per_node < 1:
            raise ValueError(
                f"num_nodes={self.num_nodes}, ranks_per_node={self.ranks_per_node}: need >= 1"
            )
        if self.num_experts % self.world_size:
            raise ValueError(
                f"num_experts={self.num_experts} is not divisible by the EP world size "
                f"{self.world_size} (= {self.num_nodes} nodes x {self.ranks_per_node} ranks)"
            )

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.ranks_per_node

    @property
    def experts_per_rank(self) -> int:
        return self.num_experts // self.world_size

    @property
    def experts_per_node(self) -> int:
        return self.num_experts // self.num_nodes

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def local_of(self, rank: int) -> int:
        return rank % self.ranks_per_node

    def rank_of(self, node: int, local: int) -> int:
        return node * self.ranks_per_node + local

    def node_ranks(self, node: int) -> list[int]:
        return [self.rank_of(node, i) for i in range(self.ranks_per_node)]

    def rail_ranks(self, local: int) -> list[int]:
        return [self.rank_of(m, local) for m in range(self.num_nodes)]

    def owner_rank(self, expert_ids: torch.Tensor) -> torch.Tensor:
        """Rank owning each (global) expert id."""
        return torch.div(expert_ids, self.experts_per_rank, rounding_mode="floor")

    def owner_node(self, expert_ids: torch.Tensor) -> torch.Tensor:
        return torch.div(expert_ids, self.experts_per_node, rounding_mode="floor")

    def expert_range(self, rank: int) -> tuple[int, int]:
        """[first, last) global expert ids owned by `rank`."""
        return rank * self.experts_per_rank, (rank + 1) * self.experts_per_rank

    def link(self, src: int, dst: int) -> str:
        """'self', 'intra' (same node) or 'inter' (different nodes)."""
        if src == dst:
            return "self"
        return "intra" if self.node_of(src) == self.node_of(dst) else "inter"


@dataclass(frozen=True)
class EPGroup:
    """This process's place in the EP layout plus its process groups (None = default world)."""

    topo: Topology
    rank: int
    world: Any = None
    node_group: Any = None
    rail_group: Any = None

    @classmethod
    def create(cls, num_nodes: int, ranks_per_node: int, num_experts: int) -> EPGroup:
        """Build the layout for the initialised default process group (one EP group of every
        rank). Collective: all ranks call it. Creates one node group per node and one rail group
        per local index."""
        if not dist.is_initialized():
            raise RuntimeError("EPGroup.create: torch.distributed is not initialised")
        topo = Topology(num_nodes, ranks_per_node, num_experts)
        if dist.get_world_size() != topo.world_size:
            raise ValueError(
                f"world size {dist.get_world_size()} != num_nodes {num_nodes} x "
                f"ranks_per_node {ranks_per_node}"
            )
        return cls.create_groups(1, topo)

    @classmethod
    def create_groups(cls, num_groups: int, topo: Topology) -> EPGroup:
        """`num_groups` EP groups of `topo.world_size` consecutive ranks each (group g holds the
        global ranks [g * R, (g + 1) * R)); returns this rank's, with EP-local rank numbers (the
        topology's) and process groups over its members. Collective: all ranks of the default
        group (num_groups * R of them) call it with the same arguments."""
        if not dist.is_initialized():
            raise RuntimeError("EPGroup.create_groups: torch.distributed is not initialised")
        R = topo.world_size
        if dist.get_world_size() != num_groups * R:
            raise ValueError(f"world size {dist.get_world_size()} != {num_groups} EP groups x {R}")
        me = dist.get_rank()
        mine = me // R
        world = node_group = rail_group = None
        # new_group is collective over the whole world: every rank creates every group, in order
        for g in range(num_groups):
            base = g * R
            w = dist.new_group([base + r for r in range(R)]) if num_groups > 1 else dist.group.WORLD
            nodes = [dist.new_group([base + r for r in topo.node_ranks(m)])
                     for m in range(topo.num_nodes)]  # fmt: skip
            rails = [dist.new_group([base + r for r in topo.rail_ranks(i)])
                     for i in range(topo.ranks_per_node)]  # fmt: skip
            if g == mine:
                rank = me - base
                world = w
                node_group = nodes[topo.node_of(rank)]
                rail_group = rails[topo.local_of(rank)]
        return cls(topo, me - mine * R, world, node_group, rail_group)

    @property
    def node(self) -> int:
        return self.topo.node_of(self.rank)

    @property
    def local(self) -> int:
        return self.topo.local_of(self.rank)
