#!/usr/bin/env bash
# Set up (idempotent) and run the whole test suite. This is the README's test command and what CI runs.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh dev
exec "${RLOO_VENV:-.venv}/bin/python" -m pytest -q -rs "$@"
