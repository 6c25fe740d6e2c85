#!/usr/bin/env bash
# The main job on a fresh machine: set up, then run the offline demo pipeline (assets -> RLOO -> judge -> registry).
# Extra arguments go to `python -m flows.demo` (e.g. --smoke, --home DIR).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh dev
exec "${RLOO_VENV:-.venv}/bin/python" -m flows.demo "$@"
