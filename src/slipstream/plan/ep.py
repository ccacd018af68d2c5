"""Expert-parallel all-to-all time of a trainer step, with and without node-deduplicated dispatch.

The copy counts are `slipstream.moe.cost_model`'s formulas (uniform random top-k routing, E
experts sharded evenly over g nodes, p0 = C(E - E/g, k) / C(E, k) the chance a node holds none of
a token's experts): a token's row crosses the inter-node link

- `exact` (plain all-to-all, one copy per remote expert): k (g - 1) / g times;
- `hierarchical` (DeepEP normal mode, one copy per remote node): (g - 1)(1 - p0) times;

each way. They are re-derived here because `slipstream.moe` imports torch and this package must
not; tests/unit/test_plan_ep.py checks both against `slipstream.moe.cost_model` exactly.

Time of a step's EP traffic on one GPU (every trainer GPU carries tokens_per_step / num_gpus
rows; the bottleneck is its inter-node link):

    comm_s = rows_per_gpu * copies * hidden * bytes_per_element * num_moe_layers
             / inter_node_bytes_per_s_per_gpu * (1 - overlap_fraction)

Not covered: intra-node (NVLink) time (~9x the bandwidth, anchors.md), skewed learned routing
(more copies to hot nodes), per-message latency, metadata bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import comb

from slipstream.plan.rates import EPRates


def p_node_missed(num_experts: int, num_nodes: int, top_k: int) -> float:
    """C(E - E/g, k) / C(E, k): a given node holds none of a token's k experts."""
    if num_experts % num_nodes:
        raise ValueError(f"num_experts={num_experts} not divisible by num_nodes={num_nodes}")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k={top_k} outside [1, num_experts={num_experts}]")
    per_node = num_experts // num_nodes
    return comb(num_experts - per_node, top_k) / comb(num_experts, top_k)


def remote_copies_per_token(dispatch: str, num_experts: int, num_nodes: int, top_k: int) -> float:
    """Expected inter-node copies of one token row per all-to-all."""
    p0 = p_node_missed(num_experts, num_nodes, top_k)
    if dispatch == "exact":
        return top_k * (num_nodes - 1) / num_nodes
    if dispatch == "hierarchical":
        return (num_nodes - 1) * (1.0 - p0)
    raise ValueError(f"unknown dispatch {dispatch!r} (exact or hierarchical)")


def predicted_inter_node_ratio(num_experts: int, num_nodes: int, top_k: int) -> float:
    """Hierarchical / exact inter-node copies (nan for one node: no inter-node traffic)."""
    if num_nodes == 1:
        return float("nan")
    return remote_copies_per_token(
        "hierarchical", num_experts, num_nodes, top_k
    ) / remote_copies_per_token("exact", num_experts, num_nodes, top_k)


def ep_comm_s(ep: EPRates, tokens_per_step: float, num_trainer_nodes: int, dispatch: str) -> float:
    """Seconds of EP all-to-all per trainer step on each GPU (see the module docstring)."""
    if not ep.enabled:
        return 0.0
    rows_per_gpu = tokens_per_step / (num_trainer_nodes * ep.gpus_per_node)
    copies = remote_copies_per_token(dispatch, ep.num_experts, ep.ep_nodes, ep.top_k)
    bytes_per_gpu = rows_per_gpu * copies * ep.hidden_size * ep.bytes_per_element
    bytes_per_gpu *= ep.num_moe_layers
    return bytes_per_gpu / ep.inter_node_bytes_per_s_per_gpu * (1.0 - ep.overlap_fraction)


@dataclass
class EPShare:
    """EP time of a step next to its compute, for both dispatch types."""

    compute_s: float
    exact_s: float
    hierarchical_s: float

    def share(self, dispatch: str) -> float:
        comm = self.exact_s if dispatch == "exact" else self.hierarchical_s
        return comm / (self.compute_s + comm) if self.compute_s + comm > 0 else 0.0

    def step_s(self, dispatch: str) -> float:
        return self.compute_s + (self.exact_s if dispatch == "exact" else self.hierarchical_s)


def ep_share(ep: EPRates, compute_s: float, tokens_per_step: float, num_nodes: int) -> EPShare:
    return EPShare(
        compute_s=compute_s,
        exact_s=ep_comm_s(ep, tokens_per_step, num_nodes, "exact"),
        hierarchical_s=ep_comm_s(ep, tokens_per_step, num_nodes, "hierarchical"),
    )
