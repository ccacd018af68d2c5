"""Metrics as JSON lines, and the rich progress bar jobs show while they train or evaluate.

`MetricsWriter(path)` appends one JSON object per `log(...)` call, each with `time_s` (UNIX time) and
flushed at once, so a crashed job keeps everything it logged and `tail -f` works. Values must be
JSON-serialisable numbers/strings; tensors are converted with `.item()` by the caller.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from types import TracebackType
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)


class MetricsWriter:
    """Append-only JSON-lines metrics file (parent directories are created)."""

    def __init__(self, path: str | Path, append: bool = False) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a" if append else "w", encoding="utf-8")

    def log(self, **values: Any) -> None:
        record = {"time_s": round(time.time(), 3)}
        for k, v in values.items():
            # JSON has no NaN/inf: write them as null so every line stays parseable.
            record[k] = None if isinstance(v, float) and not math.isfinite(v) else v
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """All records of a metrics file, in order."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def make_progress(console: Console | None = None) -> Progress:
    """A progress bar whose task carries a free-form `stats` field (e.g. "loss 1.23  4.5k tok/s")."""
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[stats]}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console,
        transient=False,
    )


def fmt_rate(per_s: float) -> str:
    """12345.6 -> "12.3k"."""
    if per_s >= 1e6:
        return f"{per_s / 1e6:.1f}M"
    if per_s >= 1e3:
        return f"{per_s / 1e3:.1f}k"
    return f"{per_s:.0f}"
