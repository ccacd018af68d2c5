"""`slipstream bench peer` end to end on a tiny model: a few seconds of SFT, then TRL's
GRPOTrainer for 4 steps from that start, scored by slipstream's evaluator. The start's score
equals `slipstream`'s own evaluation of the checkpoint (the conversion back is exact), the
evaluations land where `scripts/quickstart-summary.py --curve` reads them, and the saved policy
is not the start (TRL trained it)."""

from __future__ import annotations

import json

import pytest
import torch

from jobutil import TINY_SFT
from slipstream.cli import main
from slipstream.config import QUICKSTART, load_config
from slipstream.evaluate import heldout_pass_at_1
from slipstream.model import load_pretrained
from slipstream.tasks import get_taskset

pytest.importorskip("trl")

TINY = [*TINY_SFT, "--trainer.groups_per_step=2", "--trainer.lr=1e-2"]


def test_trl_trains_the_sft_start_and_slipstream_scores_it(tmp_path) -> None:
    args = [f"--run.output_dir={tmp_path / 'run'}", *TINY]
    assert main(["sft", *args, "--sft.steps=60"]) == 0
    init = tmp_path / "run" / "sft" / "checkpoint"
    out = tmp_path / "peer"
    rc = main(["bench", "peer", *args, "--init", str(init), "--steps", "4", "--eval-every", "2",
               "--output", str(out)])  # fmt: skip
    assert rc == 0

    cfg = load_config(str(QUICKSTART), [a.removeprefix("--") for a in args])
    taskset = get_taskset(cfg.task)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if r.get("evaluated")]
    assert [r["step"] for r in evals] == [2, 4]
    assert all(r["elapsed_s"] >= r["eval_s"] >= 0 for r in evals)
    end = rows[-1]
    assert end["event"] == "end" and end["step"] == 4
    assert end["pass_at_1_before"] == heldout_pass_at_1(load_pretrained(str(init)), taskset, cfg)
    policy = load_pretrained(str(out / "policy"))
    assert end["pass_at_1"] == heldout_pass_at_1(policy, taskset, cfg)
    start = load_pretrained(str(init)).state_dict()
    changed = [k for k, v in policy.state_dict().items() if not torch.equal(v, start[k])]
    assert changed, "TRL's 4 steps left every weight of the start as it was"
    # the routers stay frozen as in slipstream's trainer (trainer.freeze_router, the quickstart's)
    assert not [k for k in changed if ".gate." in k and "experts" not in k], changed
    record = json.loads((out / "peer.json").read_text())
    assert record["steps"] == 4 and record["samples"] == 4 * 2 * cfg.rollout.group_size
    assert record["provenance"]["trl"]


def test_bench_peer_refuses_a_start_that_is_not_a_checkpoint(tmp_path, capsys) -> None:
    assert main(["bench", "peer", "--init", str(tmp_path)]) == 2
    assert "no config.json" in capsys.readouterr().err


def test_bench_peer_refuses_a_loss_trl_does_not_have(tmp_path, capsys) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert main(["bench", "peer", "--init", str(tmp_path), "--trainer.loss=ppo"]) == 2
    assert "TRL's GRPO only" in capsys.readouterr().err
