# The two commands of the README. Each sets everything up first (idempotent, see scripts/setup.sh).
.PHONY: run test lint setup setup-dev

run: setup
	.venv/bin/slipstream run -c configs/quickstart.toml

test: setup-dev
	bash scripts/test.sh

lint: setup-dev
	.venv/bin/ruff check src tests
	.venv/bin/ruff format --check src tests

setup:
	bash scripts/setup.sh

setup-dev:
	bash scripts/setup.sh --dev
