"""`Ranks.after_backward` on replicas: every gradient is summed over the ranks, one flat
all-reduce per dtype, with a parameter no token reached counted as zero, and the summed values
land back in each parameter's own `.grad` (its shape, its dtype). Two real gloo processes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = r"""
import sys
import torch
import torch.distributed as dist
from slipstream.parallel.ranks import Ranks

rank, store = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
ranks = Ranks.current(sharded=False)
params = [torch.nn.Parameter(torch.zeros(3, 4)), torch.nn.Parameter(torch.zeros(5)),
          torch.nn.Parameter(torch.zeros(2, 2, dtype=torch.float64)),
          torch.nn.Parameter(torch.zeros(7))]
for i, p in enumerate(params[:3]):
    p.grad = torch.full_like(p, float(rank + 1)) * (i + 1)
if rank == 1:  # only rank 1's tokens reached the last parameter
    params[3].grad = torch.arange(7, dtype=torch.float32)
ranks.after_backward(params)
for i, p in enumerate(params[:3]):
    expect = torch.full_like(p, 3.0 * (i + 1))  # (1 + 2) * (i + 1)
    assert p.grad.shape == p.shape and p.grad.dtype == p.dtype, (i, p.grad.shape, p.grad.dtype)
    assert torch.equal(p.grad, expect), (i, p.grad)
assert torch.equal(params[3].grad, torch.arange(7, dtype=torch.float32)), params[3].grad
dist.destroy_process_group()
print("ok", rank)
"""


@pytest.mark.slow
def test_after_backward_sums_every_gradient_over_two_ranks(tmp_path: Path) -> None:
    script = tmp_path / "rank.py"
    script.write_text(SCRIPT)
    store = tmp_path / "store"
    procs = [subprocess.Popen([sys.executable, str(script), str(r), str(store)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for r in range(2)]  # fmt: skip
    outs = [p.communicate(timeout=120)[0].decode() for p in procs]
    for r, (p, out) in enumerate(zip(procs, outs, strict=True)):
        assert p.returncode == 0 and f"ok {r}" in out, out[-3000:]
