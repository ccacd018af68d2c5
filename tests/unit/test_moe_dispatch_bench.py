"""`slipstream bench moe-dispatch` plumbing without spawning: subcommand registration and the
group-wide aggregation of per-rank measurements (bytes summed over ranks, ms = median over
repetitions of the slowest rank, ratios vs exact, the cost-model limit)."""

from __future__ import annotations

import argparse
from typing import Any

import pytest

from slipstream.bench import moe_dispatch
from slipstream.moe import predicted_inter_node_ratio


def _meter(inter_payload: float, inter_meta: float) -> dict[str, Any]:
    zero = {"payload": 0.0, "meta": 0.0}
    phase = {
        "calls": 1,
        "self": zero,
        "intra": {"payload": 10.0, "meta": 1.0},
        "inter": {"payload": inter_payload, "meta": inter_meta},
    }
    return {"dispatch": phase, "combine": phase}


def _rank(ms: list[float], scale: float) -> dict[str, Any]:
    return {
        "configs": [
            {
                "config": [64, 32, 16, 4],
                "ms": {t: {"dispatch": ms, "combine": ms} for t in moe_dispatch.TYPES},
                "meter": {
                    "padded": _meter(500 * scale, 10),
                    "exact": _meter(400 * scale, 8),
                    "hierarchical": _meter(200 * scale, 20),
                },
                "padded_dropped": 3,
                "padded_assigned": 256,
            }
        ]
    }


def test_register_adds_subcommand() -> None:
    parser = argparse.ArgumentParser()
    moe_dispatch.register(parser.add_subparsers(dest="cmd"))
    args = parser.parse_args(["moe-dispatch", "--config", "128,64,16,2", "--reps", "2"])
    assert args.func is moe_dispatch.run and args.config == ["128,64,16,2"] and args.reps == 2


def test_aggregate_sums_ranks_and_takes_slowest() -> None:
    ranks = [_rank([1.0, 5.0, 3.0], 1.0), _rank([2.0, 1.0, 9.0], 3.0)]
    row = moe_dispatch._aggregate(ranks, 0, nodes=2)
    h, e = row["dispatchers"]["hierarchical"], row["dispatchers"]["exact"]
    assert e["dispatch_inter_bytes"] == 400 + 8 + 1200 + 8
    assert h["dispatch_inter_payload_bytes"] == 800
    assert h["dispatch_inter_ratio_vs_exact"] == pytest.approx((800 + 40) / 1616)
    assert h["dispatch_inter_payload_ratio_vs_exact"] == pytest.approx(800 / 1600)
    assert e["dispatch_inter_ratio_vs_exact"] == 1.0
    assert h["dispatch_ms"] == 5.0  # per-rep max over ranks: [2, 5, 9] -> median 5
    assert row["limit_inter_payload_ratio"] == pytest.approx(predicted_inter_node_ratio(16, 2, 4))
    assert row["dispatchers"]["padded"]["dropped_fraction"] == pytest.approx(6 / 512)
