#!/usr/bin/env bash
# Runs the test suite. pytest's exit code 5 ("no tests collected") counts as failure here: a suite
# that silently runs nothing must not pass.
set -uo pipefail
cd "$(dirname "$0")/.."
.venv/bin/ruff check src tests || exit 1
# The layering of src/ (pyproject.toml [tool.importlinter], docs/architecture.md).
.venv/bin/lint-imports --no-logo --no-cache || exit 1
.venv/bin/python -m pytest -m "not gpu" "$@"
rc=$?
if [[ $rc == 5 ]]; then echo "test: pytest collected no tests" >&2; exit 1; fi
exit $rc
