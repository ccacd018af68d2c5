"""Trainer ranks 1..W-1 as Ray actors (`run.launcher = "ray"`, trainer.num_processes > 1).

Rank 0 is the Ray driver (the job's own process, `slipstream run`); the others are actors of one
placement group, a bundle of `run.ray_trainer_resources` each, packed onto as few nodes as
possible (strategy PACK). Once placed, ranks are numbered node by node, the driver's node first,
so that each node holds consecutive ranks (what an EP group over `trainer.parallel.ranks_per_node`
assumes); a placement whose nodes do not hold whole blocks of ranks_per_node ranks is refused with
the placement in the message. Each actor then joins the process group at the driver's node IP
(NCCL on CUDA, using the GPU Ray gave it; gloo on CPU) and runs the same follower loop as a local
rank process (launch/dp.py `follow`). Same interface as `TrainerRanks`: send, lost, close.

Not covered: several nodes (run on one machine's private Ray instance only: no cluster here), a
driver without the resources of a rank (rank 0 trains on the driver's node), re-placing a lost
rank (the job fails and resumes from its last checkpoint, as with local ranks).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from pathlib import Path
from typing import Any

from slipstream.config import SlipstreamConfig
from slipstream.launch.dp import broadcast_command, join_group
from slipstream.launch.ray import import_ray, init_ray
from slipstream.rl.types import TrainerRankLost

log = logging.getLogger(__name__)

PLACEMENT_TIMEOUT_S = 300.0


class TrainerRankActor:
    """One follower trainer rank inside a Ray actor (wrapped by `ray.remote` at start)."""

    def __init__(self, config: dict[str, Any], init_checkpoint: str) -> None:
        self.config = config
        self.init_checkpoint = init_checkpoint

    def node(self) -> dict[str, Any]:
        ray = import_ray()
        return {"node_id": ray.get_runtime_context().get_node_id(), "pid": os.getpid(),
                "ip": ray.util.get_node_ip_address(), "gpu_ids": ray.get_gpu_ids()}  # fmt: skip

    def run(self, rank: int, address: str) -> int:
        import torch.distributed as dist

        from slipstream.launch.dp import follow
        from slipstream.runtime import set_threads

        logging.basicConfig(level=logging.INFO,
                            format=f"%(asctime)s rank{rank} %(levelname)s %(message)s")  # fmt: skip
        cfg = SlipstreamConfig.model_validate(self.config)
        set_threads(cfg.run)
        # Ray sets CUDA_VISIBLE_DEVICES to this actor's GPU: it is cuda:0 in here
        device = join_group(cfg, rank, address, local_gpu=0)
        try:
            return follow(cfg, self.init_checkpoint, device, rank)
        finally:
            dist.destroy_process_group()


def rank_order(driver_node: str, nodes: list[str], ranks_per_node: int) -> list[int]:
    """Bundle index of ranks 1, 2, ... given each bundle's node: the driver's node first, then
    node by node (in order of first appearance). ValueError when ranks_per_node > 0 and some node
    would not hold exactly one aligned block of ranks_per_node ranks."""
    by_node: dict[str, list[int]] = {driver_node: []}
    for i, node in enumerate(nodes):
        by_node.setdefault(node, []).append(i)
    order = [i for bundles in by_node.values() for i in bundles]
    if ranks_per_node:
        sizes = {
            node: len(b) + (node == driver_node)
            for node, b in by_node.items()
            if b or node == driver_node
        }
        if any(n != ranks_per_node for n in sizes.values()):
            raise ValueError(
                f"trainer.parallel.ranks_per_node = {ranks_per_node}, but the placement group put "
                f"{sizes} trainer ranks (incl. rank 0 on the driver's node) on the nodes: give "
                "every trainer node exactly ranks_per_node slots of run.ray_trainer_resources"
            )
    return order


def _driver_gpu(cfg: SlipstreamConfig, driver_node: str, nodes: list[dict[str, Any]]) -> int | None:
    """Rank 0's GPU on a CUDA run: the first one of the driver's node that Ray gave no rank
    actor there (the driver is not a Ray task, so Ray does not reserve one for it). Not run
    here (no GPU)."""
    from slipstream.runtime import resolve_device

    if resolve_device(cfg.run).type != "cuda":
        return None
    import torch

    taken = {int(g) for n in nodes if n["node_id"] == driver_node for g in n["gpu_ids"]}
    free = [i for i in range(torch.cuda.device_count()) if i not in taken]
    if not free:
        raise RuntimeError(
            f"rank 0 (the Ray driver) finds no GPU of its node left: Ray gave {sorted(taken)} to "
            "trainer rank actors there; advertise one slot fewer than the node's GPUs"
        )
    return free[0]


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class RayTrainerRanks:
    """Rank 0's side of follower ranks placed by Ray; see the module docstring."""

    def __init__(self, ray: Any, pg: Any, actors: list[Any], runs: list[Any], started_ray: bool,
                 placement: list[dict[str, Any]]) -> None:  # fmt: skip
        self.ray, self.pg, self.actors, self.runs = ray, pg, actors, runs
        self.started_ray = started_ray
        self.placement = placement
        """Per rank 1..W-1: node id, IP, pid, GPU ids (also in launch/trainer_ranks.json)."""

    @classmethod
    def start(cls, cfg: SlipstreamConfig, init_checkpoint: str, log_dir: Path) -> RayTrainerRanks:
        """Place ranks 1..W-1 and join the process group as rank 0 (blocks until all joined)."""
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        ray = import_ray()
        started = init_ray(cfg)
        world = cfg.trainer.num_processes
        res = dict(cfg.run.ray_trainer_resources)
        bundles = [res for _ in range(world - 1)]
        pg = placement_group(bundles, strategy="PACK", name=f"slipstream-trainer-{os.getpid()}")
        try:
            ready, _ = ray.wait([pg.ready()], timeout=PLACEMENT_TIMEOUT_S)
            if not ready:
                raise TimeoutError(
                    f"the Ray cluster could not place {world - 1} trainer ranks of "
                    f"{res} each within {PLACEMENT_TIMEOUT_S:.0f} s (run.ray_trainer_resources)"
                )
            actor_cls = ray.remote(TrainerRankActor)
            spec = cfg.model_dump(mode="json")
            res_opts = {k: v for k, v in res.items() if k not in ("CPU", "GPU")}
            actors = [
                actor_cls.options(
                    num_cpus=res.get("CPU", 0), num_gpus=res.get("GPU", 0),
                    resources=res_opts or None,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i),
                ).remote(spec, init_checkpoint)
                for i in range(world - 1)
            ]  # fmt: skip
            nodes = ray.get([a.node.remote() for a in actors], timeout=PLACEMENT_TIMEOUT_S)
            driver_node = ray.get_runtime_context().get_node_id()
            order = rank_order(driver_node, [n["node_id"] for n in nodes],
                               cfg.trainer.parallel.ranks_per_node)  # fmt: skip
            ip = ray.util.get_node_ip_address()
            address = f"{ip}:{_free_port(ip)}"
            runs = [None] * (world - 1)
            for rank, i in enumerate(order, start=1):
                runs[rank - 1] = actors[i].run.remote(rank, address)
            ranked_actors = [actors[i] for i in order]
            placement = [{"rank": r, **nodes[i]} for r, i in enumerate(order, start=1)]
            log_dir.mkdir(parents=True, exist_ok=True)
            (log_dir.parent / "trainer_ranks.json").write_text(json.dumps(placement, indent=1))
            group = cls(ray, pg, ranked_actors, runs, started, placement)
            join_group(cfg, 0, address, local_gpu=_driver_gpu(cfg, driver_node, nodes))
        except BaseException:
            remove_placement_group(pg)
            if started:
                ray.shutdown()
            raise
        return group

    def send(self, command: tuple[Any, ...]) -> None:
        """Broadcast one command to the followers (launch/dp.py); rank 0 then does its part."""
        broadcast_command(command)

    def lost(self) -> TrainerRankLost | None:
        done, _ = self.ray.wait(self.runs, num_returns=len(self.runs), timeout=0)
        if not done:
            return None
        names = []
        for rank, ref in enumerate(self.runs, start=1):
            if ref in done:
                try:
                    why = f"returned {self.ray.get(ref)}"
                except self.ray.exceptions.RayError as e:
                    why = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                names.append(f"rank {rank} ({why})")
        return TrainerRankLost(f"trainer {', '.join(names)} ended during the run, so the step "
                               "could not complete; the job resumes from its last checkpoint "
                               "when started again")  # fmt: skip

    def close(self, timeout_s: float = 30.0) -> list[int | None]:
        """Wait for the followers (after ("stop",)); kill the others; exit codes (None: killed
        or failed). Removes the placement group; shuts Ray down if this started it."""
        import torch.distributed as dist
        from ray.util.placement_group import remove_placement_group

        deadline = time.monotonic() + timeout_s
        codes: list[int | None] = []
        for ref in self.runs:
            try:
                codes.append(int(self.ray.get(ref, timeout=max(0.1, deadline - time.monotonic()))))
            except (self.ray.exceptions.RayError, self.ray.exceptions.GetTimeoutError):
                codes.append(None)
        for actor in self.actors:
            self.ray.kill(actor)
        remove_placement_group(self.pg)
        if dist.is_initialized():
            dist.destroy_process_group()
        if self.started_ray:
            self.ray.shutdown()
        return codes
