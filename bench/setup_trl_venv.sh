#!/usr/bin/env bash
# Builds .venv-trl: a clean venv with TRL (bench/requirements-trl.txt), used by bench/vs_trl.py and by
# tests/engine/test_trl_parity.py (TRL's own `trl rloo` parser against ours). TRL is never a project dependency.
#   bash bench/setup_trl_venv.sh [--no-project] [VENV_DIR]   # default .venv-trl at the repository root
# --no-project leaves out this checkout (the parity test needs TRL only): no editable install, so CI can build it
# while the main setup installs the same checkout. About 100 s here from a warm pip cache (2026-12-06, 2 cores).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
project=1
if [ "${1:-}" = "--no-project" ]; then project=0; shift; fi
venv="${1:-$root/.venv-trl}"
started=$SECONDS
python3 -m venv "$venv"
# torch first, pinned: a bare `torch` requirement (from trl or the project) would resolve to a CUDA build.
"$venv/bin/pip" install --quiet "torch==2.13.0"
if [ "$project" = 1 ]; then "$venv/bin/pip" install --quiet -e "$root"; fi
"$venv/bin/pip" install --quiet -r "$root/bench/requirements-trl.txt"
"$venv/bin/python" -c "import torch, trl; print(f'{trl.__name__} {trl.__version__}, torch {torch.__version__}')"
if [ "$project" = 1 ]; then "$venv/bin/python" -c "import rloo_engine"; fi
echo "setup_trl_venv: $venv built in $((SECONDS - started)) s"
