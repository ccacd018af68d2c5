#!/usr/bin/env bash
# Runs the test suite. pytest's exit code 5 ("no tests collected") counts as failure here: a suite
# that silently runs nothing must not pass.
#
# Then, for the whole suite (no arguments), the GPU tests' logic on the CPU
# (SLIPSTREAM_GPU_TESTS_ON_CPU=1, tests/gpu/conftest.py): machines without a GPU would skip them,
# and tests nobody runs rot (a GPU test called a Trainer method that no longer existed). Either
# run failing fails the script. With arguments, only the main pytest runs, with them.
set -uo pipefail
cd "$(dirname "$0")/.."
.venv/bin/ruff check src tests || exit 1
# The layering of src/ (pyproject.toml [tool.importlinter], docs/architecture.md).
.venv/bin/lint-imports --no-logo --no-cache || exit 1
# --durations: every run names its 30 slowest tests (the full suite has a 25-minute budget)
.venv/bin/python -m pytest -m "not gpu" --durations=30 "$@"
rc=$?
if [[ $rc == 5 ]]; then echo "test: pytest collected no tests" >&2; exit 1; fi
if [[ $# == 0 ]]; then
  SLIPSTREAM_GPU_TESTS_ON_CPU=1 .venv/bin/python -m pytest tests/gpu -m "gpu and not slow"
  gpu_rc=$?
  if [[ $gpu_rc == 5 ]]; then echo "test: the GPU tests' CPU mode collected no tests" >&2; exit 1; fi
  if [[ $gpu_rc != 0 ]]; then
    echo "test: the GPU tests' CPU mode failed (rc $gpu_rc)" >&2
    [[ $rc == 0 ]] && rc=$gpu_rc
  fi
fi
exit $rc
