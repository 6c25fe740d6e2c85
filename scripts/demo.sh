#!/usr/bin/env bash
# The main job on a fresh machine: set up, build tiny offline assets, run RLOO on configs/tiny.yaml.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh dev
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
venv="${RLOO_VENV:-.venv}"
[ -d .rloo-tiny/policy ] || "$venv/bin/rloo-engine" tiny-assets .rloo-tiny
exec "$venv/bin/rloo-engine" train --config configs/tiny.yaml "$@"
