"""Single-process parts of the EP dispatch stack: topology arithmetic, the byte meter's link
classification, the node-count cost model (closed form vs enumeration vs Monte Carlo), the
dispatcher factory and its guards. The multi-process dispatch itself is tested in
tests/integration/test_moe_ep.py."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from slipstream.moe import (
    ByteMeter,
    Dispatcher,
    EPGroup,
    Topology,
    expected_distinct_nodes,
    expected_remote_experts,
    expected_remote_nodes,
    make_dispatcher,
    predicted_inter_node_ratio,
)
from slipstream.moe.base import HandleBase
from slipstream.moe.cost_model import distinct_nodes_per_token, random_topk


def test_topology_layout_and_links() -> None:
    t = Topology(num_nodes=2, ranks_per_node=2, num_experts=16)
    assert (t.world_size, t.experts_per_rank, t.experts_per_node) == (4, 4, 8)
    assert [t.node_of(r) for r in range(4)] == [0, 0, 1, 1]
    assert t.node_ranks(1) == [2, 3] and t.rail_ranks(1) == [1, 3]
    assert t.expert_range(3) == (12, 16)
    ids = torch.tensor([0, 3, 4, 7, 8, 15])
    assert t.owner_rank(ids).tolist() == [0, 0, 1, 1, 2, 3]
    assert t.owner_node(ids).tolist() == [0, 0, 0, 0, 1, 1]
    assert [t.link(1, d) for d in range(4)] == ["intra", "self", "inter", "inter"]
    with pytest.raises(ValueError, match="not divisible"):
        Topology(2, 2, 6)


def test_meter_classifies_links_and_kinds() -> None:
    t = Topology(2, 2, 8)
    m = ByteMeter()
    m.start_call("dispatch")
    m.add("dispatch", "payload", t, 0, [0, 1, 2, 3], [5, 3, 2, 1], 100)
    m.add("dispatch", "meta", t, 0, [0, 1, 2, 3], [1, 1, 1, 1], 8)
    assert m.per_call("dispatch", "self", "payload") == 500
    assert m.per_call("dispatch", "intra", "payload") == 300
    assert m.per_call("dispatch", "inter", "payload") == 300
    assert m.per_call("dispatch", "inter") == 316
    assert m.rows[("dispatch", "inter", "payload")] == 3
    assert m.summary()["dispatch"]["inter"] == {"payload": 300.0, "meta": 16.0}
    with pytest.raises(ValueError, match="no 'combine' calls"):
        m.per_call("combine", "inter")


def _enumerated_distinct_nodes(E: int, g: int, k: int) -> float:
    """Mean number of distinct nodes over ALL k-subsets of E experts (exact, small E)."""
    per = E // g
    total = n = 0
    for combo in itertools.combinations(range(E), k):
        total += len({e // per for e in combo})
        n += 1
    return total / n


@pytest.mark.parametrize(("E", "g", "k"), [(8, 2, 2), (12, 3, 4), (16, 4, 3), (10, 5, 5)])
def test_cost_model_matches_enumeration(E: int, g: int, k: int) -> None:
    assert expected_distinct_nodes(E, g, k) == pytest.approx(_enumerated_distinct_nodes(E, g, k))
    # remote = distinct minus P(own node hit) = (g-1)/g of distinct, by symmetry
    assert expected_remote_nodes(E, g, k) == pytest.approx(
        expected_distinct_nodes(E, g, k) * (g - 1) / g
    )


@pytest.mark.parametrize(("E", "g", "k"), [(64, 2, 8), (64, 8, 8), (256, 8, 8), (32, 4, 2)])
def test_cost_model_vs_monte_carlo(E: int, g: int, k: int) -> None:
    n = 20000
    gen = torch.Generator().manual_seed(E * 100 + g * 10 + k)
    d = distinct_nodes_per_token(random_topk(n, E, k, generator=gen), E, g).double()
    se = d.std().item() / math.sqrt(n)
    assert abs(d.mean().item() - expected_distinct_nodes(E, g, k)) < 5 * se + 1e-9


def test_cost_model_known_values_and_ratio() -> None:
    # g = 1: every token hits exactly one node, nothing crosses nodes
    assert expected_distinct_nodes(16, 1, 4) == pytest.approx(1.0)
    assert math.isnan(predicted_inter_node_ratio(16, 1, 4))
    # k = 1: exactly one node, and hierarchical == exact
    assert expected_distinct_nodes(64, 8, 1) == pytest.approx(1.0)
    assert predicted_inter_node_ratio(64, 8, 1) == pytest.approx(1.0)
    # DeepSeek-V3-like: 256 experts, top-8, 8 nodes -> well under 8 nodes per token
    assert 4.0 < expected_distinct_nodes(256, 8, 8) < 8.0
    assert expected_remote_experts(64, 2, 8) == pytest.approx(4.0)
    assert predicted_inter_node_ratio(64, 2, 8) == pytest.approx(
        expected_distinct_nodes(64, 2, 8) / 8
    )
    with pytest.raises(ValueError, match="top_k"):
        expected_distinct_nodes(8, 2, 9)


def _fake_group() -> EPGroup:
    # no process groups needed to construct: dispatchers only talk at dispatch/combine time
    return EPGroup(Topology(2, 2, 8), rank=1, world=None, node_group=object(), rail_group=object())


@pytest.mark.parametrize("typ", ["padded", "exact", "hierarchical"])
def test_factory_builds_protocol_instances(typ: str) -> None:
    d = make_dispatcher(typ, _fake_group())
    assert isinstance(d, Dispatcher)
    assert d.type == typ


def test_factory_and_input_errors() -> None:
    with pytest.raises(ValueError, match="deepep"):
        make_dispatcher("deepep", _fake_group())
    with pytest.raises(ValueError, match="node/rail groups"):
        make_dispatcher("hierarchical", EPGroup(Topology(2, 2, 8), rank=0))
    d = make_dispatcher("exact", _fake_group())
    x, w = torch.zeros(3, 4), torch.ones(3, 2)
    with pytest.raises(ValueError, match="outside"):
        d.dispatch(x, torch.tensor([[0, 8]] * 3), w)
    with pytest.raises(ValueError, match="expected x"):
        d.dispatch(x, torch.zeros(3, 3, dtype=torch.int64), w)


def test_padded_capacity_rule() -> None:
    p = make_dispatcher("padded", _fake_group(), capacity_factor=1.25)
    assert p.capacity_for(num_tokens=100, top_k=2) == math.ceil(1.25 * 200 / 4)
    assert make_dispatcher("padded", _fake_group(), capacity=7).capacity_for(100, 2) == 7


def test_combine_refuses_detached_y() -> None:
    d = make_dispatcher("exact", _fake_group())
    h = HandleBase(num_tokens=2, needs_grad=True)
    with pytest.raises(RuntimeError, match="hang the group"):
        d._check_y(torch.zeros(3, 4), h, 3)
    with pytest.raises(ValueError, match="expected 5"):
        d._check_y(torch.zeros(3, 4, requires_grad=True), h, 5)
