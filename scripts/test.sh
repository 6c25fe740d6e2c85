#!/usr/bin/env bash
# Set up (idempotent), lint, and run the whole test suite. This is the README's test command and what CI runs.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh dev
venv="${RLOO_VENV:-.venv}"
echo "lint: ruff check (config in pyproject.toml)"
"$venv/bin/ruff" check .
exec "$venv/bin/python" -m pytest -q -rsfE --durations=30 "$@"
