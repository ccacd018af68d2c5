"""Cost model for node-aware EP dispatch under uniform random top-k routing.

With E experts spread evenly (contiguously) over g nodes and each token choosing k distinct
experts uniformly at random, a given node holds none of a token's experts with probability
p0 = C(E - E/g, k) / C(E, k), so (reference/anchors.md, DeepEP normal mode)

    expected distinct destination nodes per token = g * (1 - p0)

and, by symmetry, expected distinct REMOTE nodes = (g - 1) * (1 - p0): the number of times a
token crosses the inter-node link with the hierarchical dispatcher (each way). The exact
dispatcher sends one copy per remote expert: k * (g - 1) / g expected. Their ratio,
g * (1 - p0) / k, is the predicted hierarchical / exact inter-node payload ratio.
Not covered: skewed (learned) routing, which makes real ratios differ, and metadata bytes.
"""

from __future__ import annotations

from math import comb

import torch


def _p_node_missed(num_experts: int, num_nodes: int, top_k: int) -> float:
    if num_experts % num_nodes:
        raise ValueError(f"num_experts={num_experts} not divisible by num_nodes={num_nodes}")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k={top_k} outside [1, num_experts={num_experts}]")
    per_node = num_experts // num_nodes
    return comb(num_experts - per_node, top_k) / comb(num_experts, top_k)


def expected_distinct_nodes(num_experts: int, num_nodes: int, top_k: int) -> float:
    """g * (1 - C(E - E/g, k) / C(E, k))."""
    return num_nodes * (1.0 - _p_node_missed(num_experts, num_nodes, top_k))


def expected_remote_nodes(num_experts: int, num_nodes: int, top_k: int) -> float:
    """Expected inter-node copies per token for node-aware dispatch: (g - 1) * (1 - p0)."""
    return (num_nodes - 1) * (1.0 - _p_node_missed(num_experts, num_nodes, top_k))


def expected_remote_experts(num_experts: int, num_nodes: int, top_k: int) -> float:
    """Expected inter-node copies per token for per-assignment (exact) dispatch: k (g - 1) / g."""
    _p_node_missed(num_experts, num_nodes, top_k)  # validates
    return top_k * (num_nodes - 1) / num_nodes


def predicted_inter_node_ratio(num_experts: int, num_nodes: int, top_k: int) -> float:
    """Hierarchical / exact inter-node payload bytes under uniform routing: g (1 - p0) / k."""
    if num_nodes == 1:
        return float("nan")  # no inter-node traffic at all
    return expected_remote_nodes(num_experts, num_nodes, top_k) / expected_remote_experts(
        num_experts, num_nodes, top_k
    )


def random_topk(
    num_tokens: int, num_experts: int, top_k: int, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Uniform random routing: k distinct experts per token (top-k of i.i.d. random scores)."""
    scores = torch.rand(num_tokens, num_experts, generator=generator)
    return torch.topk(scores, top_k, dim=1).indices


def distinct_nodes_per_token(
    topk_idx_NK: torch.Tensor, num_experts: int, num_nodes: int
) -> torch.Tensor:
    """Number of distinct nodes among each token's experts (contiguous expert sharding)."""
    node_NK = torch.div(topk_idx_NK, num_experts // num_nodes, rounding_mode="floor")
    hit = torch.zeros(topk_idx_NK.shape[0], num_nodes, dtype=torch.bool, device=topk_idx_NK.device)
    hit.scatter_(1, node_NK, True)
    return hit.sum(1)
