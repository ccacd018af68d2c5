"""scripts/quickstart-summary.py reads a quickstart run dir (plain or gzipped metrics) and
reports the gain, the first evaluation past the peer's +16.8 points and the job's wall time."""

from __future__ import annotations

import gzip
import json
import runpy
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "quickstart-summary.py"


def _write_run(run_dir: Path, evals: list[tuple[int, float, float]], *, gz: bool) -> None:
    (run_dir / "sft").mkdir(parents=True)
    (run_dir / "sft" / "metrics.jsonl").write_text(
        json.dumps({"step": 2400, "elapsed_s": 140.5}) + "\n"
    )
    rows = [
        {"step": s, "num_samples": 64, "pass_at_1": p, "evaluated": True, "elapsed_s": t}
        for s, p, t in evals
    ]
    rows.append(
        {"event": "end", "pass_at_1_before": 0.50, "pass_at_1": evals[-1][1], "wall_s": 80.0}
    )
    text = "".join(json.dumps(r) + "\n" for r in rows)
    if gz:
        with gzip.open(run_dir / "metrics.jsonl.gz", "wt") as f:
            f.write(text)
    else:
        (run_dir / "metrics.jsonl").write_text(text)


def test_summary_finds_the_first_evaluation_past_the_peer_gain(tmp_path: Path) -> None:
    summarise = runpy.run_path(str(SCRIPT))["summarise"]
    run = tmp_path / "quickstart-seed0"
    # +16.0 at step 250 is short of +16.8; +17.0 at step 500 passes it.
    _write_run(run, [(250, 0.66, 20.0), (500, 0.67, 41.0), (1000, 0.75, 80.0)], gz=True)
    s = summarise(run, {"quickstart-seed0": 230.0})
    assert (s["reached_step"], s["reached_s"]) == (500, 41.0)
    assert round(s["gain_points"], 6) == 25.0
    assert s["sft_s"] == 140.5 and s["job_s"] == 230.0
    assert s["samples_per_s"] == 3 * 64 / 80.0


def test_summary_says_when_the_gain_is_never_reached(tmp_path: Path) -> None:
    summarise = runpy.run_path(str(SCRIPT))["summarise"]
    run = tmp_path / "r"
    _write_run(run, [(250, 0.55, 20.0), (1000, 0.60, 80.0)], gz=False)
    s = summarise(run, {})
    assert s["reached_step"] is None and s["job_s"] is None
