"""`[trainer.parallel]`: how the trainer's ranks split the model and the data.

    world = trainer.num_processes = dp_replicate x dp_shard x ep      (tp = pp = 1)

- Data: every rank trains its own share of each batch (groups r, r + world, ...).
- Dense parameters (attention, router, norms, embeddings, LM head) are FSDP2-sharded over the
  dp_shard x ep ranks of a replica; expert weights are split over the ep ranks of an EP group
  (each holds num_experts / ep experts) and FSDP2-sharded over the dp_shard ranks that hold the
  same experts. Tokens reach the experts that own them through `trainer.ep_dispatcher`.
- dp_replicate > 1 replicates the whole model (gradients all-reduced, the plain data-parallel
  trainer); it needs dp_shard = ep = 1 (hybrid sharding is not built).

In torchtitan's terms: dp_shard x ep here is its dp_shard (the dense FSDP mesh), dp_shard here
is its expert-FSDP degree (`efsdp`), and ep is its ep.
"""

from __future__ import annotations

from pydantic import Field, model_validator

from slipstream.config.base import Section


class ParallelConfig(Section):
    dp_replicate: int = Field(default=0, ge=0)
    """Model replicas (gradients all-reduced). 0: resolved at load to
    trainer.num_processes / (dp_shard x ep)."""
    dp_shard: int = Field(default=1, ge=1)
    """Ranks that FSDP-shard the same experts (and, times ep, the dense parameters)."""
    ep: int = Field(default=1, ge=1)
    """Expert-parallel degree: ranks that split the experts of each MoE layer. Must divide
    model.num_experts and trainer.num_processes."""
    tp: int = Field(default=1, ge=1)
    """Tensor parallelism: not built; anything but 1 is refused."""
    pp: int = Field(default=1, ge=1)
    """Pipeline parallelism: not built; anything but 1 is refused."""
    ranks_per_node: int = Field(default=0, ge=0)
    """Trainer ranks per machine, for the node-aware dispatcher and the byte meter's intra/inter
    split. 0: every rank on one node. On one machine a smaller value simulates several nodes
    (consecutive ranks form a node). Must divide ep, or ep must divide it."""

    @model_validator(mode="after")
    def _not_built(self) -> ParallelConfig:
        for key in ("tp", "pp"):
            if getattr(self, key) != 1:
                raise ValueError(
                    f"trainer.parallel.{key} = {getattr(self, key)}: "
                    f"{'tensor' if key == 'tp' else 'pipeline'} parallelism is not built; use 1"
                )
        return self

    @property
    def sharded(self) -> bool:
        """Whether the trainer uses the FSDP2 (+ EP) layout rather than plain replication."""
        return self.dp_shard * self.ep > 1

    def check(self, num_processes: int, num_experts: int) -> None:
        """Raise ValueError naming the key when this layout cannot run num_processes ranks of a
        model with num_experts experts (after dp_replicate is resolved)."""
        if self.dp_replicate * self.dp_shard * self.ep != num_processes:
            raise ValueError(
                f"trainer.parallel: dp_replicate ({self.dp_replicate}) x dp_shard "
                f"({self.dp_shard}) x ep ({self.ep}) must equal trainer.num_processes "
                f"({num_processes})"
            )
        if self.dp_replicate > 1 and self.sharded:
            raise ValueError(
                f"trainer.parallel.dp_replicate = {self.dp_replicate} with dp_shard x ep = "
                f"{self.dp_shard * self.ep}: replicas of a sharded model (HSDP) are not built; "
                "use dp_replicate = 1, or dp_shard = ep = 1 for plain data parallelism"
            )
        if self.ep > 1 and num_experts % self.ep:
            raise ValueError(
                f"trainer.parallel.ep = {self.ep} does not divide model.num_experts = {num_experts}"
            )
        rpn = self.ranks_per_node
        if rpn and self.ep > 1 and rpn % self.ep and self.ep % rpn:
            raise ValueError(
                f"trainer.parallel.ranks_per_node = {rpn} and trainer.parallel.ep = {self.ep}: "
                "one must divide the other (an EP group spans whole nodes or fits in one)"
            )
