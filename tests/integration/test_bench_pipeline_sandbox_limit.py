"""`bench pipeline`'s sandbox limit: real bwrap pools (one per rollout worker) verify the code
task's reference solutions — every one passes (reward 1.0), so the sandboxes ran the tests — and
report verifications per second; without reuse every verification gets a fresh sandbox, with
reuse the pools recycle theirs. Nothing is left behind after (journal empty)."""

from __future__ import annotations

from pathlib import Path

import pytest

from sandboxutil import needs_bwrap
from slipstream.bench import pipeline
from slipstream.config import load_config
from slipstream.sandbox.journal import Journal

pytestmark = needs_bwrap


@pytest.mark.parametrize("reuse", [False, True])
def test_sandbox_limit_verifies_references_in_real_pools(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, reuse: bool
) -> None:
    monkeypatch.setattr(pipeline, "SANDBOX_LIMIT_VERIFICATIONS_PER_POOL", 6)
    cfg = load_config(None, [
        "task.name=code", "sandbox.backend=bwrap", "sandbox.memory_mib=256",
        "sandbox.workdir_mib=32", f"sandbox.reuse={str(reuse).lower()}",
        f"sandbox.state_dir={tmp_path}/state", "rollout.max_inflight_tasks=2",
        "rollout.group_size=2",
    ])  # fmt: skip
    lim = pipeline._sandbox_limit(cfg, num_pools=2)
    assert lim["verifications"] == 12 and lim["pools"] == 2
    assert lim["threads_per_pool"] == 4  # min(verify_threads, max_inflight_tasks x group_size)
    assert lim["reward_mean"] == 1.0
    assert lim["samples_per_s"] == pytest.approx(12 / lim["wall_s"])
    if reuse:
        assert lim["sandboxes_created"] < 12
    else:
        assert lim["sandboxes_created"] >= 12  # one fresh sandbox per verification
    assert Journal(tmp_path / "state").entries() == []
