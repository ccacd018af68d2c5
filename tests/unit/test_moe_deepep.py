"""The `deepep` dispatcher without DeepEP: it is registered, refuses clearly where it cannot run
(no `deep_ep`, CPU or non-floating tensors, layouts DeepEP's kernels do not support, low-latency
calls with gradients or too many tokens), and sizes its DeepEP Buffer from DeepEP's hints. The
mapping itself runs in tests/integration/test_moe_ep_deepep.py against a fake Buffer; the real
kernels were never run here."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from fake_deep_ep import FakeBuffer, FakeDeepEP
from slipstream.moe import DISPATCHER_TYPES, Dispatcher, EPGroup, Topology, make_dispatcher
from slipstream.moe.deepep import DeepEPDispatcher, DeepEPUnavailable, _ll_recv_counts


class FakeProcessGroup:
    """What DeepEP's Buffer reads from a torch ProcessGroup: rank() and size()."""

    def __init__(self, rank: int, size: int) -> None:
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


def group(nodes: int = 1, per_node: int = 4, experts: int = 8, rank: int = 1) -> EPGroup:
    world = FakeProcessGroup(rank, nodes * per_node)
    return EPGroup(Topology(nodes, per_node, experts), rank, world, object(), object())


def fake(g: EPGroup | None = None, **opts) -> DeepEPDispatcher:
    return DeepEPDispatcher(g or group(), backend=FakeDeepEP, **opts)


def test_registered_and_refused_without_deep_ep() -> None:
    assert DISPATCHER_TYPES["deepep"] == "slipstream.moe.deepep:DeepEPDispatcher"
    if importlib.util.find_spec("deep_ep") is not None:
        pytest.skip("deep_ep is importable here: the refusal cannot be observed")
    with pytest.raises(DeepEPUnavailable, match="deep_ep.*not importable.*Dockerfile.gpu"):
        make_dispatcher("deepep", group())
    # a ValueError, as for an unknown type: callers choosing a dispatcher by name catch one kind
    with pytest.raises(ValueError, match="deepep"):
        make_dispatcher("deepep", group())


def test_builds_a_protocol_instance_with_a_backend() -> None:
    d = make_dispatcher("deepep", group(), backend=FakeDeepEP)
    assert isinstance(d, Dispatcher) and d.type == "deepep" and d.mode == "normal"


@pytest.mark.parametrize(
    ("nodes", "per_node", "mode", "match"),
    [
        (1, 1, "normal", "at least 2 ranks"),
        (1, 1, "low_latency", "at least 2 ranks"),
        (2, 2, "normal", "8 consecutive ranks as one NVLink node: for 4 ranks use 1 x 4"),
        (4, 4, "normal", "for 16 ranks use 2 x 8"),
        (1, 6, "normal", "world size 6 has no tuned DeepEP config"),
    ],
)
def test_refuses_layouts_the_kernels_cannot_run(
    nodes: int, per_node: int, mode: str, match: str
) -> None:
    with pytest.raises(DeepEPUnavailable, match=match):
        fake(group(nodes, per_node, experts=48, rank=0), mode=mode)


@pytest.mark.parametrize(("nodes", "per_node", "mode"),
                         [(1, 2, "normal"), (1, 8, "normal"), (2, 8, "normal"),
                          (2, 2, "low_latency"), (3, 1, "low_latency")])  # fmt: skip
def test_accepts_layouts_the_kernels_run(nodes: int, per_node: int, mode: str) -> None:
    assert fake(group(nodes, per_node, experts=48, rank=0), mode=mode).mode == mode


def test_option_errors() -> None:
    with pytest.raises(ValueError, match="mode='fast'"):
        fake(mode="fast")
    with pytest.raises(ValueError, match="num_sms=3"):
        fake(num_sms=3)
    with pytest.raises(ValueError, match="num_max_dispatch_tokens_per_rank=0"):
        fake(mode="low_latency", num_max_dispatch_tokens_per_rank=0)
    before = FakeBuffer.num_sms
    try:
        fake(num_sms=24)
        assert FakeBuffer.num_sms == 24  # Buffer.set_num_sms: a class-wide DeepEP setting
    finally:
        FakeBuffer.num_sms = before


def _inputs(n: int = 3, dtype: torch.dtype = torch.bfloat16, grad: bool = False):
    x = torch.randn(n, 16, dtype=dtype, requires_grad=grad)
    return x, torch.tensor([[0, 5]] * n), torch.full((n, 2), 0.5)


def test_refuses_cpu_and_non_floating_tensors() -> None:
    x, idx, w = _inputs()
    with pytest.raises(ValueError, match="need CUDA tensors; got x on cpu, topk_idx on cpu"):
        fake().dispatch(x, idx, w)
    with pytest.raises(ValueError, match="x is torch.int64; expected floating activations"):
        fake(require_cuda=False).dispatch(x.long(), idx, w)
    with pytest.raises(ValueError, match="outside"):  # the shared input checks still apply
        fake(require_cuda=False).dispatch(x, torch.tensor([[0, 8]] * 3), w)


def test_low_latency_refuses_gradients_and_too_many_tokens() -> None:
    d = fake(mode="low_latency", require_cuda=False, num_max_dispatch_tokens_per_rank=2)
    x, idx, w = _inputs(n=2, grad=True)
    with pytest.raises(RuntimeError, match="inference-only"):
        d.dispatch(x, idx, w)
    x, idx, w = _inputs(n=3)
    with pytest.raises(ValueError, match="3 tokens exceed num_max_dispatch_tokens_per_rank=2"):
        d.dispatch(x, idx, w)


def test_buffer_sized_from_deepeps_hints() -> None:
    FakeBuffer.instances.clear()
    d = fake()
    b = d._ensure_buffer(64)
    # normal: max over the dispatch and combine configs' hints, for bf16 rows (64 x 2 bytes)
    assert (b.num_nvl_bytes, b.num_rdma_bytes, b.low_latency_mode) == (20 * 256 * 128 * 4, 0, False)
    assert b.group is d.group.world and d._ensure_buffer(32) is b  # smaller rows: same buffer
    assert d._ensure_buffer(128) is not b and len(FakeBuffer.instances) == 2
    ll = fake(mode="low_latency", num_max_dispatch_tokens_per_rank=16)._ensure_buffer(64)
    assert (ll.num_nvl_bytes, ll.low_latency_mode, ll.num_qps_per_rank) == (0, True, 2)
    assert ll.num_rdma_bytes == FakeBuffer.get_low_latency_rdma_size_hint(16, 64, 4, 8)


def test_low_latency_handle_layout_is_checked() -> None:
    begin_count = torch.tensor([[(0 << 32) | 2, (2 << 32) | 1], [(0 << 32) | 0, (0 << 32) | 4]])
    handle = (None, begin_count)
    assert _ll_recv_counts(handle, [3, 4], 2) == [2, 5]
    with pytest.raises(RuntimeError, match="disagree with packed_recv_count"):
        _ll_recv_counts(handle, [3, 5], 2)
    with pytest.raises(RuntimeError, match="expected \\(2, 4\\)"):
        _ll_recv_counts(handle, [3, 4], 4)
