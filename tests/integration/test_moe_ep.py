"""Expert-parallel dispatch for real: 4 gloo processes (2 simulated nodes x 2 ranks, 8 experts)
run every dispatcher against the single-process reference MoE, forward and backward, plus the
padded drop accounting and the measured inter-node traffic under uniform routing. One spawn for
the module (slipstream.moe.selfcheck.all_checks); each test inspects its part."""

from __future__ import annotations

import math
from typing import Any

import pytest

from slipstream.moe import expected_remote_nodes
from slipstream.moe.launch import spawn_ep

# one spawn of 4 processes for the module: ~30 s on the shared 2-core machine
pytestmark = pytest.mark.slow

TYPES = ("padded", "exact", "hierarchical")
TOL = 1e-5


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return spawn_ep("slipstream.moe.selfcheck:all_checks", 2, 2, 8, timeout_s=120)


@pytest.mark.parametrize("typ", TYPES)
def test_matches_reference_forward_and_backward(ranks: list[dict[str, Any]], typ: str) -> None:
    assert [r["reference"][typ]["tokens"] for r in ranks] == [24, 19, 0, 9]  # uneven, one empty
    for rank, r in enumerate(ranks):
        c = r["reference"][typ]
        assert c["out_scale"] > 0.1  # the comparison is not vacuous
        for key in ("out", "x_grad", "gate_grad", "gate_up_grad", "down_grad"):
            assert c[key] < TOL, f"rank {rank} {typ} {key}: max abs diff {c[key]}"


def _group_bytes(
    ranks: list[dict[str, Any]], section: str, typ: str, phase: str, link: str
) -> float:
    """Bytes per call summed over all ranks (every byte is counted once, at its sender)."""
    return sum(sum(r[section][typ]["meter"][phase][link].values()) for r in ranks)


@pytest.mark.parametrize("phase", ["dispatch", "combine"])
def test_hierarchical_sends_fewer_inter_node_bytes(ranks: list[dict[str, Any]], phase: str) -> None:
    for section in ("reference", "routing"):
        get = ranks[0][section]
        assert "exact" in get and "hierarchical" in get
        hier = _group_bytes(ranks, section, "hierarchical", phase, "inter")
        exact = _group_bytes(ranks, section, "exact", phase, "inter")
        assert 0 < hier < exact, f"{section} {phase}: hierarchical {hier} vs exact {exact}"


def test_padded_drops_counted_and_zeroed(ranks: list[dict[str, Any]]) -> None:
    for rank, r in enumerate(ranks):
        d = r["drop"]
        assert d["num_dropped"] > 0, f"rank {rank}: the skewed routing must overflow capacity"
        assert d["num_dropped"] == d["expected_dropped"] == d["dropped_mask_sum"]
        assert d["dropped_total"] == d["num_dropped"] and d["assigned_total"] == 64
        assert d["out"] < TOL, f"rank {rank}: output != reference with dropped weights zeroed"


def test_measured_inter_node_rows_match_routing(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        g = r["routing"]
        # hierarchical: exactly one inter-node copy per (token, remote node); exact: per expert
        assert g["hierarchical"]["inter_payload_rows"] == g["distinct_remote_nodes"]
        assert g["exact"]["inter_payload_rows"] == g["remote_experts"]
    for typ in ("exact", "hierarchical"):
        sent = sum(r["routing"][typ]["inter_payload_rows"] for r in ranks)
        back = sum(r["routing"][typ]["combine_inter_payload_rows"] for r in ranks)
        assert sent == back, f"{typ}: combine must mirror dispatch over the inter-node link"


def test_measured_remote_nodes_vs_cost_model(ranks: list[dict[str, Any]]) -> None:
    tokens = sum(r["routing"]["tokens"] for r in ranks)
    k = ranks[0]["routing"]["top_k"]
    measured = sum(r["routing"]["hierarchical"]["inter_payload_rows"] for r in ranks) / tokens
    p = expected_remote_nodes(8, 2, k)  # g = 2: remote-node count per token is Bernoulli(p)
    se = math.sqrt(p * (1 - p) / tokens)
    assert abs(measured - p) < 5 * se + 1e-3, f"measured {measured} vs model {p}"


def test_model_families_match_one_process(ranks: list[dict[str, Any]]) -> None:
    """Each family's MoE block (its routing scheme, router and correction bias, shared experts)
    expert-parallel over the 4 ranks equals one process: outputs and every gradient."""
    from slipstream.moe.selfcheck import FAMILIES

    for rank, r in enumerate(ranks):
        assert set(r["families"]) == set(FAMILIES)
        for family, diffs in r["families"].items():
            assert diffs.pop("correction_bias_trainable") is False
            assert diffs.pop("out_scale") > 0.1
            for key, d in diffs.items():
                assert d < TOL, f"rank {rank} {family} {key}: max relative diff {d}"
