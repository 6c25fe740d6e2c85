#!/usr/bin/env bash
# Installs rloo-pipeline into ./.venv: the CPU torch build where there is no CUDA, then the project.
# Usage: scripts/setup.sh [extras]   (default extras: dev)
#   TORCH_INDEX_URL=...  pip index to take torch from (e.g. https://download.pytorch.org/whl/cpu)
#   RLOO_VENV=...        where to create the virtual environment (default ./.venv)
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-dev}"
venv="${RLOO_VENV:-.venv}"
python="${PYTHON:-python3}"

if [ ! -x "$venv/bin/python" ]; then
  "$python" -m venv "$venv"
fi
pip=("$venv/bin/python" -m pip --disable-pip-version-check -q)
# This image's pip config names local indexes that may be absent; pip warns once per package about them.
quiet() { "$@" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }; }

if ! "$venv/bin/python" -c "import torch" 2>/dev/null; then
  index=()
  if [ -n "${TORCH_INDEX_URL:-}" ]; then index=(--index-url "$TORCH_INDEX_URL"); fi
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then
    echo "setup: CUDA found, installing the default torch build"
    quiet "${pip[@]}" install "${index[@]}" "torch>=2.4"
  else
    # A bare `torch` requirement would pull a multi-GB CUDA build; pin the CPU wheel first.
    echo "setup: no CUDA, installing the CPU torch build (torch==2.13.0)"
    quiet "${pip[@]}" install "${index[@]}" "torch==2.13.0"
  fi
fi
echo "setup: installing rloo-pipeline[$extras]"
PYTHONWARNINGS=ignore quiet "${pip[@]}" install -e ".[$extras]"  # setuptools notes every editable build
echo "setup: done ($("$venv/bin/python" -c 'import torch, transformers; print(f"torch {torch.__version__}, transformers {transformers.__version__}")'))"
