"""scripts/gpu-check.sh and scripts/gpu-wheels.sh without a GPU: the dry run CI relies on (builds
the device's wheelhouse from PyPI into a temporary directory, verifies it, checks the gpu test
selection and that those tests skip without CUDA), the rehearsal of the full check's phases on
the CPU, and the wheelhouse verifier's refusals (offline)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def sh(
    *args: str, env: dict[str, str] | None = None, timeout: int = 300
) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})  # fmt: skip


@pytest.mark.slow
def test_dry_run_passes(tmp_path: Path) -> None:
    house = tmp_path / "wheelhouse"
    r = sh("scripts/gpu-check.sh", "--dry-run", str(tmp_path / "out"),
           env={"SLIPSTREAM_WHEELHOUSE": str(house)})  # fmt: skip
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert "dry run: ready" in r.stdout and "FAIL" not in r.stdout
    for check in ("wheelhouse built and verified", "selects the GPU tests, all in tests/gpu",
                  "phase limits", "within the device's 64 MiB"):  # fmt: skip
        assert any(line.startswith("gpu-check: ok") and check in line
                   for line in r.stdout.splitlines()), check  # fmt: skip
    names = {w.name.split("-")[0].lower() for w in house.glob("*.whl")}
    assert {"pydantic", "pydantic_core", "fastapi", "starlette", "uvicorn"} <= names
    assert not names & {"torch", "numpy", "transformers"}  # the device has those
    summary = json.loads((tmp_path / "out" / "gpu-check-dry-run.json").read_text())
    assert summary["failures"] == 0 and 0 < summary["wheelhouse_bytes"] < 48 * 2**20


@pytest.mark.slow
def test_rehearsal_runs_every_phase_and_writes_the_summary(tmp_path: Path) -> None:
    out = tmp_path / "out"
    r = sh("scripts/gpu-check.sh", "--rehearse", str(out),
           env={"SLIPSTREAM_GPU_TESTS_ON_CPU": "0"})  # fmt: skip
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    summary = json.loads((out / "gpu-check.json").read_text())
    assert summary["mode"] == "rehearsal" and summary["ok"] is True
    assert [p["name"] for p in summary["phases"]] == [
        "gpu-tests", "bench-train", "engine-mid", "engine-qwen", "e2e"
    ]  # fmt: skip
    assert summary["train_bench"] == ["train_mid.json", "train_qwen3.json"]
    assert summary["pytest"]["gpu-tests"]["tests"] >= 7
    assert summary["provenance"]["tree_sha256"]
    assert summary["engine_bench"] == ["engine_mid.json", "engine_qwen.json"]
    assert "result arithmetic held-out pass@1" in (out / "gpu-check.log").read_text()
    assert len(list(out.iterdir())) <= 8  # what the device machine sends back


def test_wheelhouse_verifier_names_each_problem(tmp_path: Path) -> None:
    for name in ("pydantic-2.7.0-py3-none-any.whl", "pydantic-2.8.0-py3-none-any.whl",
                 "pydantic_core-2.20.0-cp311-cp311-manylinux_2_17_x86_64.whl",
                 "ujson-5.0-cp312-cp312-macosx_11_0_arm64.whl"):  # fmt: skip
        (tmp_path / name).write_bytes(b"x" * 1000)
    r = sh(
        "scripts/gpu-wheels.sh",
        "--verify",
        env={"SLIPSTREAM_WHEELHOUSE": str(tmp_path), "SLIPSTREAM_WHEELHOUSE_MAX_MIB": "0.001"},
    )
    assert r.returncode == 1
    for problem in ("pydantic: 2 versions", "pydantic_core-2.20.0-cp311", "macosx_11_0_arm64",
                    "requested 'fastapi>=0.110' has no wheel", "MiB > limit"):  # fmt: skip
        assert problem in r.stderr, (problem, r.stderr)


def test_usage_errors() -> None:
    r = sh("scripts/gpu-check.sh", "--bogus")
    assert r.returncode == 2 and "unknown option --bogus" in r.stderr
    r = sh("scripts/gpu-check.sh", "--help")
    assert r.returncode == 0 and "--dry-run" in r.stdout and "8 minutes" in r.stdout
    r = sh("scripts/gpu-check.sh", "--rehearse")
    assert r.returncode == 2 and "usage" in r.stderr
