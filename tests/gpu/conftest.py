"""GPU tests (marker `gpu`, one module per topic): skipped cleanly where torch sees no CUDA device.

Fixtures: `gpu` (the torch device the tests run on), `record` (writes what a test measured as
one JSON line to $SLIPSTREAM_GPU_RESULTS when set: scripts/gpu-check.sh collects them with
provenance; a no-op otherwise).

SLIPSTREAM_GPU_TESTS_ON_CPU=1 runs these tests on the CPU instead of skipping them, to check
their logic on a machine without a GPU (NCCL becomes gloo). Results of such a run say nothing
about CUDA; `record` tags them device=cpu.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

ON_CPU = os.environ.get("SLIPSTREAM_GPU_TESTS_ON_CPU") == "1"


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("gpu") and not torch.cuda.is_available() and not ON_CPU:
        pytest.skip("needs a CUDA device: torch.cuda.is_available() is False")


@pytest.fixture
def gpu() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture
def record(request: pytest.FixtureRequest, gpu: torch.device) -> Callable[..., None]:
    path = os.environ.get("SLIPSTREAM_GPU_RESULTS")

    def write(**data: Any) -> None:
        entry = {"test": request.node.nodeid, "device": str(gpu), "time_s": time.time(), **data}
        if gpu.type == "cuda":
            entry["device_name"] = torch.cuda.get_device_name(gpu)
        request.node.user_properties.append(("record", json.dumps(data, default=str)))
        if path:
            with open(path, "a") as f:
                f.write(json.dumps(entry, default=str) + "\n")

    return write
