"""Cluster cost of a configuration, and the EP share of its trainer step.

cost ($/h) = trainer nodes x on-demand price
           + rollout nodes x (Spot share x Spot price + (1 - Spot share) x on-demand price)
           + CPU verifier nodes x their price (shared sandbox pool only).
Spot share counts whole instances (as the simulator does). Prices are inputs; nothing is
fetched. Not covered: storage, network egress, idle capacity while a Spot node is replaced
(billed as if present), reserved/savings-plan pricing.
"""

from __future__ import annotations

from slipstream.plan.ep import ep_share
from slipstream.plan.rates import PlanConfig


def num_spot_instances(plan: PlanConfig) -> int:
    ro = plan.rollout
    return round(ro.spot_fraction * ro.num_instances)


def cost_per_hour(plan: PlanConfig) -> float:
    tr, ro, vf = plan.trainer, plan.rollout, plan.verifier
    spot_nodes = num_spot_instances(plan) * ro.nodes_per_instance
    od_nodes = ro.num_instances * ro.nodes_per_instance - spot_nodes
    cost = tr.num_nodes * tr.price_per_node_hour
    cost += od_nodes * ro.price_per_node_hour + spot_nodes * ro.spot_price_per_node_hour
    if vf.pool == "shared":
        cost += vf.num_nodes * vf.price_per_node_hour
    return cost


def cost_per_1k_samples(plan: PlanConfig, samples_per_s: float) -> float:
    """$ per 1,000 trained samples (inf when nothing is trained)."""
    if samples_per_s <= 0:
        return float("inf")
    return cost_per_hour(plan) / (samples_per_s * 3.6)


def describe_ep(plan: PlanConfig) -> str:
    """One paragraph on the trainer step's EP all-to-all share (empty when EP is off)."""
    from slipstream.plan.dists import dist_mean
    from slipstream.plan.ep import predicted_inter_node_ratio
    from slipstream.plan.sim import tokens_per_step, trainer_step_parts_s

    tr = plan.trainer
    if not tr.ep.enabled:
        return ""
    scale, _ = trainer_step_parts_s(plan)
    compute = dist_mean(tr.step_s) * scale + tr.publish_s
    share = ep_share(tr.ep, compute, tokens_per_step(plan), tr.num_nodes)
    ratio = predicted_inter_node_ratio(tr.ep.num_experts, tr.ep.ep_nodes, tr.ep.top_k)
    return (
        f"EP all-to-all per trainer step at {tr.num_nodes} nodes (E={tr.ep.num_experts}, "
        f"k={tr.ep.top_k}, over g={tr.ep.ep_nodes} nodes; inter-node copies hierarchical/exact "
        f"= {ratio:.3f}): exact {share.exact_s:.1f} s = {share.share('exact'):.0%} of a "
        f"{share.step_s('exact'):.1f} s step; node-deduplicated {share.hierarchical_s:.1f} s = "
        f"{share.share('hierarchical'):.0%} of {share.step_s('hierarchical'):.1f} s "
        f"(simulating: {tr.ep.dispatch})"
    )
