"""`slipstream bench moe-experts` end to end on a tiny shape (a smoke run, no timing assertions),
and the provenance record it embeds."""

import argparse
import json

from slipstream.bench import moe_experts
from slipstream.observe.provenance import collect_provenance


def test_moe_experts_bench_writes_json(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    moe_experts.register(parser.add_subparsers())
    out = tmp_path / "moe.json"
    args = parser.parse_args(
        [
            "moe-experts",
            "--shape",
            "64,32,16,4,2",
            "--reps",
            "1",
            "--warmup",
            "0",
            "--out",
            str(out),
        ]
    )
    assert args.func(args) == 0
    data = json.loads(out.read_text())
    assert [r["mode"] for r in data["results"]] == ["fwd", "fwd_bwd"]
    row = data["results"][0]
    assert row["grouped_ms"] > 0 and row["loop_ms"] > 0 and row["dense_equiv_limit_ms"] > 0
    assert row["speedup_vs_loop"] == row["loop_ms"] / row["grouped_ms"]
    assert data["provenance"]["command"] == "slipstream bench moe-experts"
    assert "speedup" in capsys.readouterr().out


def test_provenance_fields():
    prov = collect_provenance({"python": "overridden", "extra_key": 1})
    for key in ("hostname", "cpu_model", "nproc", "kernel", "torch", "slipstream", "timestamp_utc"):
        assert key in prov
    assert prov["python"] == "overridden" and prov["extra_key"] == 1
    assert prov["timestamp_utc"].endswith("+00:00")
    assert prov["git_commit"] is None or len(prov["git_commit"]) == 40
