#!/usr/bin/env bash
# Builds .venv-trl: a clean venv with the project and TRL, used only by bench/vs_trl.py (TRL is a bench requirement).
#   bash bench/setup_trl_venv.sh [VENV_DIR]       # default .venv-trl at the repository root
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
venv="${1:-$root/.venv-trl}"
python3 -m venv "$venv"
# torch first, pinned: a bare `torch` requirement (from trl or the project) would resolve to a CUDA build.
"$venv/bin/pip" install --quiet "torch==2.13.0"
"$venv/bin/pip" install --quiet -e "$root"
"$venv/bin/pip" install --quiet -r "$root/bench/requirements-trl.txt"
"$venv/bin/python" -c "import torch, trl, rloo_engine; print(f'{trl.__name__} {trl.__version__}, torch {torch.__version__}')"
