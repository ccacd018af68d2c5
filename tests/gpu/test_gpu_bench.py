"""`slipstream bench engine` on CUDA (native engine vs Hugging Face generate vs raw decode) runs
and writes its JSON with provenance. A smoke run of the benchmark on a tiny workload: no speed
is asserted (the figures are recorded); scripts/gpu-check.sh runs the benchmark proper."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu


def test_engine_bench_runs_on_cuda(gpu, record, tmp_path: Path) -> None:
    out = tmp_path / "engine.json"
    cmd = [
        sys.executable, "-c", "from slipstream.cli import main; raise SystemExit(main())",
        "bench", "engine", f"--device={gpu.type}", "--models=quickstart", "--workloads=4x4",
        "--max-new-tokens=16", "--repeats=1", f"--out={out}",
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    (row,) = result["results"]
    figures = {k: row[k]["tokens_per_s"] for k in ("native", "hf_generate", "limit_raw_decode")}
    record(tokens_per_s=figures, native_over_hf=row["native_over_hf"])
    assert all(v > 0 for v in figures.values()), figures
    assert result["settings"]["device"] == gpu.type
    assert result["provenance"]["cuda_available"] is (gpu.type == "cuda")
