"""Final report (reward-curve PNG + Markdown) and the plain progress output."""

from __future__ import annotations

import io
from pathlib import Path

from rich.console import Console

from slipstream.observe.progress import RLProgress
from slipstream.observe.report import write_report


def test_report_writes_png_and_markdown(tmp_path: Path) -> None:
    records = [
        {"step": i, "reward_mean": i / 20, "pass_at_1": 0.1, "evaluated": i % 5 == 0}
        for i in range(1, 21)
    ]
    path = write_report(tmp_path, {"steps": 20, "held-out pass@1 after": 0.4}, records)
    png = tmp_path / "reward_curve.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = path.read_text()
    assert "reward_curve.png" in text and "held-out pass@1 after" in text


def test_plain_progress_prints_one_line_per_step() -> None:
    buf = io.StringIO()
    with RLProgress(Console(file=buf, width=200), plain=True) as progress:
        progress.update({"event": "start", "pass_at_1": 0.25, "steps": 2, "step": 0})
        for step in (1, 2):
            progress.update({"step": step, "reward_mean": 0.5, "pass_at_1": 0.25, "samples_per_s": 10.0,
                             "staleness_mean": 0.5, "staleness_max": 1, "queue_pending": 3,
                             "queue_leased": 4, "trainer_idle_frac": 0.1})  # fmt: skip
    lines = buf.getvalue().strip().splitlines()
    assert len(lines) == 2 and lines[1].startswith("step 2/2 reward 0.500")
