"""The planner's EP copy counts equal slipstream.moe.cost_model's (which imports torch, so the
planner re-derives them), and the step-time formula by hand."""

from __future__ import annotations

import pytest

from slipstream.moe import cost_model
from slipstream.plan.ep import (
    ep_comm_s,
    p_node_missed,
    predicted_inter_node_ratio,
    remote_copies_per_token,
)
from slipstream.plan.rates import EPRates

SHAPES = [(8, 2, 2), (16, 2, 2), (32, 4, 4), (64, 2, 8), (64, 8, 8), (256, 8, 8), (256, 2, 8),
          (256, 16, 8), (384, 8, 8), (512, 4, 10)]  # fmt: skip


@pytest.mark.parametrize(("e", "g", "k"), SHAPES)
def test_copy_counts_equal_the_moe_cost_model(e: int, g: int, k: int) -> None:
    assert p_node_missed(e, g, k) == cost_model._p_node_missed(e, g, k)
    assert remote_copies_per_token("exact", e, g, k) == cost_model.expected_remote_experts(e, g, k)
    assert remote_copies_per_token("hierarchical", e, g, k) == cost_model.expected_remote_nodes(
        e, g, k
    )
    assert predicted_inter_node_ratio(e, g, k) == cost_model.predicted_inter_node_ratio(e, g, k)


def test_comm_seconds_by_hand() -> None:
    ep = EPRates(enabled=True, num_experts=64, top_k=8, hidden_size=1024, num_moe_layers=2,
                 ep_nodes=2, gpus_per_node=4, bytes_per_element=2.0,
                 inter_node_bytes_per_s_per_gpu=1e9, overlap_fraction=0.5)  # fmt: skip
    # 8 GPUs on 2 trainer nodes carry 8000 / 8 = 1000 rows; exact: 8 * 1/2 = 4 copies each
    expected = 1000 * 4 * 1024 * 2.0 * 2 / 1e9 * 0.5
    assert ep_comm_s(ep, 8000, 2, "exact") == pytest.approx(expected)
    hier = ep_comm_s(ep, 8000, 2, "hierarchical")
    assert hier / ep_comm_s(ep, 8000, 2, "exact") == pytest.approx(
        cost_model.predicted_inter_node_ratio(64, 2, 8)
    )
    assert ep_comm_s(ep.model_copy(update={"enabled": False}), 8000, 2, "exact") == 0.0
    with pytest.raises(ValueError, match="unknown dispatch"):
        remote_copies_per_token("deepep", 64, 2, 8)
