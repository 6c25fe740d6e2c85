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
    quiet "${pip[@]}" install "${index[@]}" "torch>=2.13"
  else
    # A bare `torch` requirement would pull a multi-GB CUDA build; pin the CPU wheel first.
    echo "setup: no CUDA, installing the CPU torch build (torch==2.13.0)"
    quiet "${pip[@]}" install "${index[@]}" "torch==2.13.0"
  fi
fi
# The project install takes ~30 s even when nothing changed, so it is skipped when the venv was set up
# from this very pyproject.toml with these extras, and still imports this checkout (not a moved copy).
stamp="$venv/.rloo-setup-stamp"
want="$("$venv/bin/python" - "$extras" <<'PY'
import hashlib, sys
print(hashlib.sha256(open("pyproject.toml", "rb").read() + b"\0" + sys.argv[1].encode()).hexdigest(), sys.argv[1])
PY
)"
installed_here() {
  "$venv/bin/python" -c 'import os, sys, rloo_engine; sys.exit(os.path.dirname(os.path.dirname(os.path.realpath(rloo_engine.__file__))) != os.path.realpath(os.getcwd()))' 2>/dev/null
}
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && installed_here; then
  echo "setup: $venv already has rloo-pipeline[$extras] for this pyproject.toml; skipping the install (rm $stamp to force)"
else
  echo "setup: installing rloo-pipeline[$extras]"
  rm -f "$stamp"
  if [[ ",$extras," == *",dev,"* || ",$extras," == *",deepspeed,"* ]]; then
    # Before the project, so its `deepspeed` extra is already met: DeepSpeed's build imports the installed
    # torch, so it cannot use pip's isolated build environment. The tests run ZeRO-2/3 for real on CPU.
    echo "setup: installing deepspeed (--no-build-isolation)"
    quiet "${pip[@]}" install --no-build-isolation "deepspeed>=0.19"
  fi
  PYTHONWARNINGS=ignore quiet "${pip[@]}" install -e ".[$extras]"  # setuptools notes every editable build
  echo "$want" > "$stamp"
fi
if "$venv/bin/python" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('deepspeed') is None)" && \
    ! "$venv/bin/python" -c "import sys, torch; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then
  # DeepSpeed on CPU compiles its communication op on first use (minutes on a loaded core); once here, under a
  # bound, instead of inside the first DeepSpeed run (where a timeout killed the compile and left a lock behind).
  echo "setup: DeepSpeed's CPU communication op (compiled once, loaded when already built)"
  DS_ACCELERATOR=cpu timeout 1200 "$venv/bin/python" -c \
    "from rloo_engine.torch_extensions import build_shm_comm_op; build_shm_comm_op()" 2>&1 | tail -2
fi
echo "setup: done ($("$venv/bin/python" -c 'import torch, transformers; print(f"torch {torch.__version__}, transformers {transformers.__version__}")'))"
