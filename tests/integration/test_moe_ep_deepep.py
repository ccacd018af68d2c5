"""The `deepep` dispatcher's mapping onto DeepEP's Buffer API, end to end in 4 gloo processes
(1 node x 4 ranks, 8 experts, uneven tokens incl. a rank with none) against a FAKE Buffer
(tests/fake_deep_ep.py: DeepEP's documented semantics reimplemented with torch.distributed).
Normal mode forward and backward and low-latency forward must equal the single-process reference
MoE (bf16, so within bf16 rounding), and the calls the dispatcher made must be the ones DeepEP's
API expects. The real kernels were never run: this cannot show that they behave as the fake."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from slipstream.moe.launch import spawn_ep

pytestmark = pytest.mark.slow  # one spawn of 4 processes

# bf16 has 8 significant bits: one rounding of a value of size s is up to s / 256; the EP and the
# reference paths round partial sums at different points, so allow a few roundings of the scale.
REL_TOL = 4 / 256


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return spawn_ep("fake_deep_ep:deepep_checks", 1, 4, 8, timeout_s=120)


def test_normal_mode_matches_reference_forward_and_backward(ranks: list[dict[str, Any]]) -> None:
    assert [r["tokens"] for r in ranks] == [24, 19, 0, 9]
    for rank, r in enumerate(ranks):
        c = r["normal"]
        assert r["out_scale"] > 0.1 and c["grad_scale"] > 0.01  # not a vacuous comparison
        assert c["out"] <= REL_TOL * r["out_scale"], f"rank {rank} out: {c['out']}"
        for key in ("x_grad", "gate_grad", "gate_up_grad", "down_grad"):
            assert c[key] <= REL_TOL * max(1.0, c["grad_scale"]), f"rank {rank} {key}: {c[key]}"


def test_low_latency_mode_matches_reference_forward(ranks: list[dict[str, Any]]) -> None:
    for rank, r in enumerate(ranks):
        assert r["low_latency"]["out"] <= REL_TOL * r["out_scale"], f"rank {rank}"


def test_float32_activations_travel_as_bf16_and_come_back_float32(
    ranks: list[dict[str, Any]],
) -> None:
    for rank, r in enumerate(ranks):
        c = r["fp32"]
        assert c["dtype"] == torch.float32
        assert c["out"] <= REL_TOL * max(r["out_scale"], c["out_scale"]), f"rank {rank}: {c}"


def test_calls_follow_deepeps_api(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        n = r["normal"]
        # one normal buffer sized by the dispatch/combine config hints for bf16 rows (D = 16)
        ((nvl, rdma, ll, _qps),) = n["buffers"]
        assert (nvl, rdma, ll) == (20 * 256 * 16 * 2 * 4, 0, False)
        names = [name for name, _ in n["calls"]]
        # forward: layout, dispatch, combine; backward: combine's is a cached dispatch, then
        # dispatch's is a combine carrying the routing-weight gradients
        assert names == ["get_dispatch_layout", "dispatch", "combine", "dispatch_cached", "combine"]
        layout, dispatch = (summary for _, summary in n["calls"][:2])
        assert layout == {"topk_idx_dtype": torch.int64, "num_experts": 8}
        assert (dispatch["x_dtype"], dispatch["w_dtype"]) == (torch.bfloat16, torch.float32)
        assert (dispatch["num_worst_tokens"], dispatch["async_finish"]) == (0, False)
        assert n["calls"][2][1]["with_weights"] is False and n["calls"][4][1]["with_weights"]
        low = r["low_latency"]
        ((nvl, rdma, ll, qps),) = low["buffers"]
        assert (nvl, ll, qps) == (0, True, 2)  # one queue pair per local expert (8 / 4)
        assert rdma == 2 * 24 * 16 * 2 * 4 * 8  # the size hint for 24 tokens x D 16
        (ld, lc) = low["calls"]
        assert ld == (
            "low_latency_dispatch",
            {
                "num_max": 24,
                "num_experts": 8,
                "use_fp8": False,
                "async_finish": False,
                "return_recv_hook": False,
            },
        )
        assert lc[0] == "low_latency_combine" and lc[1]["return_recv_hook"] is False


def test_meter_counts_copies_per_destination(ranks: list[dict[str, Any]]) -> None:
    def total(mode: str, phase: str, kind: str) -> float:
        return sum(r[mode]["meter"][phase][link][kind] for r in ranks
                   for link in ("self", "intra", "inter"))  # fmt: skip

    # normal: combine sends back exactly what dispatch delivered (bf16 rows of D = 16)
    assert total("normal", "dispatch", "payload") == total("normal", "combine", "payload") > 0
    # top-k ids (int64) + weights (fp32) travel with each normal copy: K x 12 bytes vs 32
    assert total("normal", "dispatch", "meta") > total("normal", "dispatch", "payload") * 24 / 32
    # low latency: one copy per (token, expert) = 52 tokens x K 2, both ways
    assert total("low_latency", "dispatch", "payload") == 52 * 2 * 16 * 2
    assert total("low_latency", "combine", "payload") == 52 * 2 * 16 * 2
    assert all(r["normal"]["meter"]["dispatch"]["inter"]["payload"] == 0 for r in ranks)
