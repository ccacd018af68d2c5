"""Raw sweep samples: one row per (cell, repeat, iteration, sandbox), success or failure.

samples.csv is the source of truth: aggregates, plots and the report are always computed from the
file as read back (also right after a run), so `slipstream sweep report DIR` rebuilds them
byte-identically. Times are written with microsecond resolution.

A failed sample keeps its row: ok=0, `reason` (timeout, exit, oom, crash, create) and `detail`.
Its latency_s is the time until the failure was observed (empty if it never started).
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass, fields
from pathlib import Path

FAILURE_REASONS = ("timeout", "exit", "oom", "crash", "create")


@dataclass
class Sample:
    config_id: str
    backend: str
    pinning: str
    memory: str
    smt: str
    density: float  # requested sandboxes per vCPU
    num_sandboxes: int
    repeat: int
    iteration: int
    sandbox: int
    cpus: str  # cpulist the sandbox was pinned to ("" = unpinned)
    ok: bool
    reason: str  # "" for a success, else one of FAILURE_REASONS
    detail: str
    t_start_s: float  # since the start of the run (NaN if the workload never started)
    latency_s: float  # host-side wall time of the workload (NaN if it never started)


COLUMNS = [f.name for f in fields(Sample)]


def _fmt(value: object) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, float):
        return "" if math.isnan(value) else f"{value:.6f}"
    return str(value)


def write_samples(path: str | Path, samples: list[Sample]) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.writer(f, lineterminator="\n")
        writer.writerow(COLUMNS)
        for s in samples:
            writer.writerow([_fmt(getattr(s, c)) for c in COLUMNS])


def _float(text: str) -> float:
    return math.nan if text == "" else float(text)


def read_samples(path: str | Path) -> list[Sample]:
    """Read samples.csv; fails naming the file and line on a malformed row."""
    path = Path(path)
    out: list[Sample] = []
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        if reader.fieldnames != COLUMNS:
            raise ValueError(f"{path}: columns {reader.fieldnames} != expected {COLUMNS}")
        for lineno, row in enumerate(reader, start=2):
            try:
                out.append(
                    Sample(
                        config_id=row["config_id"],
                        backend=row["backend"],
                        pinning=row["pinning"],
                        memory=row["memory"],
                        smt=row["smt"],
                        density=float(row["density"]),
                        num_sandboxes=int(row["num_sandboxes"]),
                        repeat=int(row["repeat"]),
                        iteration=int(row["iteration"]),
                        sandbox=int(row["sandbox"]),
                        cpus=row["cpus"],
                        ok=row["ok"] == "1",
                        reason=row["reason"],
                        detail=row["detail"],
                        t_start_s=_float(row["t_start_s"]),
                        latency_s=_float(row["latency_s"]),
                    )
                )
            except (KeyError, ValueError) as e:
                raise ValueError(f"{path}:{lineno}: bad sample row {row}: {e}") from e
    return out
