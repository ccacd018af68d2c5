"""observe/op_count.py: the dispatch-mode counter sees forward and backward ops and every kind of
host sync the trainer must avoid."""

from __future__ import annotations

import torch

from slipstream.observe.op_count import count_ops


def test_counts_forward_backward_ops() -> None:
    w = torch.randn(4, 3, requires_grad=True)
    x = torch.randn(2, 3)

    def step() -> None:
        (x @ w.t()).square().sum().backward()

    c = count_ops(step)
    assert c.syncs == 0
    assert c.by_name["aten::mm"] >= 2  # forward and the weight gradient
    assert c.ops == sum(c.by_name.values())
    assert 0 < c.kernels <= c.ops


def test_counts_each_host_sync() -> None:
    x = torch.randn(6)
    cases = {
        "aten::_local_scalar_dense": lambda: x.sum().item(),
        "aten::nonzero": lambda: torch.nonzero(x > 0),
        "aten::index(bool mask)": lambda: x[x > 0],
        "Tensor.tolist": lambda: x.tolist(),
    }
    for name, fn in cases.items():
        c = count_ops(fn)
        assert c.syncs == 1, (name, c.by_name)
        assert c.sync_ops() == {name: 1}, c.by_name
    assert count_ops(lambda: x.sort().values.cumsum(0)).syncs == 0
