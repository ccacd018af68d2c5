"""The trainer ranks' layout (`[trainer.parallel]`) as this process sees it, and its meshes.

    layout = Layout.from_config(cfg.trainer)           # after init_process_group
    meshes = build_meshes(layout, "cpu")                # collective
    ep = build_ep_group(layout, num_experts)           # collective; None when ep == 1

Ranks are laid out as a (dp_shard, ep) grid with ep the fast dimension: an EP group is `ep`
consecutive ranks (so with ranks_per_node >= ep its all-to-alls stay inside a node), and the
ranks at the same EP position hold the same experts and FSDP-shard them among themselves.

    meshes.dense    1-D, every rank of the replica: FSDP2 of the dense parameters
    meshes.experts  1-D, the dp_shard ranks at my EP position: FSDP2 of my experts
    meshes.ep       1-D, my EP group: where expert weights are placed (Shard(0))

`meshes.experts` and `meshes.ep` are slices of one 2-D mesh, which is what lets FSDP2 and DCP
see an expert weight as one global (E, ...) tensor sharded over both (placements
`(_StridedShard(0), Shard(0))`), and reshard it when a checkpoint is loaded onto another layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from slipstream.config.rl import TrainerConfig
from slipstream.moe.rank_layout import EPGroup, Topology


@dataclass(frozen=True)
class Layout:
    """world = dp_replicate x dp_shard x ep (config resolved), and this process's rank."""

    world: int
    rank: int
    dp_replicate: int
    dp_shard: int
    ep: int
    ranks_per_node: int

    @classmethod
    def from_config(cls, tc: TrainerConfig) -> Layout:
        par = tc.parallel
        rank = dist.get_rank() if dist.is_initialized() else 0
        world = dist.get_world_size() if dist.is_initialized() else 1
        if world != tc.num_processes:
            raise RuntimeError(
                f"{world} trainer processes joined, trainer.num_processes is {tc.num_processes}"
            )
        return cls(world, rank, par.dp_replicate, par.dp_shard, par.ep, par.ranks_per_node)

    @property
    def sharded(self) -> bool:
        """FSDP2 (+ EP) rather than whole-model replicas."""
        return self.dp_shard * self.ep > 1

    @property
    def ep_position(self) -> int:
        """My index inside my EP group."""
        return self.rank % self.ep

    def ep_topology(self, num_experts: int) -> Topology:
        """The node structure of one EP group (EP-local ranks): several nodes when the group
        spans machines (ranks_per_node < ep), one node otherwise."""
        rpn = self.ranks_per_node or self.world
        if rpn >= self.ep:
            return Topology(1, self.ep, num_experts)
        return Topology(self.ep // rpn, rpn, num_experts)


@dataclass(frozen=True)
class Meshes:
    dense: DeviceMesh
    experts: DeviceMesh
    ep: DeviceMesh


def build_meshes(layout: Layout, device_type: str) -> Meshes:
    """The sharded layout's meshes (collective: every rank calls it). Needs dp_replicate == 1."""
    if not layout.sharded:
        raise ValueError("build_meshes: the layout is not sharded (dp_shard x ep == 1)")
    if layout.dp_replicate != 1:
        raise ValueError("build_meshes: replicas of a sharded model (HSDP) are not built")
    grid = init_device_mesh(
        device_type, (layout.dp_shard, layout.ep), mesh_dim_names=("dp_shard", "ep")
    )
    dense = grid["dp_shard", "ep"]._flatten("dense")
    return Meshes(dense=dense, experts=grid["dp_shard"], ep=grid["ep"])


def build_ep_group(layout: Layout, num_experts: int) -> EPGroup | None:
    """This rank's EP group with the process groups the dispatchers use (collective), or None
    when ep == 1."""
    if layout.ep == 1:
        return None
    topo = layout.ep_topology(num_experts)
    return EPGroup.create_groups(layout.world // layout.ep, topo)
