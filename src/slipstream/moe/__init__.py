"""Expert-parallel (EP) MoE token dispatch/combine: the `Dispatcher` protocol and its padded,
exact-split and hierarchical (node-aware) all-to-all implementations, the rank topology, the byte
meter and the node-count cost model. See docs/moe-ep.md. Importing this package imports torch."""

from slipstream.moe.base import DISPATCHER_TYPES, Dispatcher, make_dispatcher
from slipstream.moe.cost_model import (
    expected_distinct_nodes,
    expected_remote_experts,
    expected_remote_nodes,
    predicted_inter_node_ratio,
)
from slipstream.moe.layer import ExpertParallelMoE, run_local_experts, shard_experts
from slipstream.moe.meter import ByteMeter
from slipstream.moe.rank_layout import EPGroup, Topology

__all__ = [
    "DISPATCHER_TYPES",
    "ByteMeter",
    "Dispatcher",
    "EPGroup",
    "ExpertParallelMoE",
    "Topology",
    "expected_distinct_nodes",
    "expected_remote_experts",
    "expected_remote_nodes",
    "make_dispatcher",
    "predicted_inter_node_ratio",
    "run_local_experts",
    "shard_experts",
]
