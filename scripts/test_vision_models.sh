#!/usr/bin/env bash
# The vision-language tests whose processor needs torchvision (Qwen2-VL, Qwen2.5-VL: transformers checks their
# video processor's class even when none is given, and that check needs torchvision). No torchvision wheel loads
# beside this project's CPU torch 2.13.0 (PyPI's are CUDA builds: "operator torchvision::nms does not exist"), so
# this lane runs them on the matched pair a user with these models installs, torch 2.14.1 and torchvision 0.29.1
# (CUDA builds, run on the CPU). CI runs it in .ci/run's lane 2.
#
# The pair and the CUDA libraries torch loads go into an overlay directory inside the venv, put first on
# PYTHONPATH; every other package is the main venv's (what pip brought besides is removed, so nothing else is
# shadowed). Installing the overlay takes about a minute (5 GB, from the local wheel store). Any skipped test fails
# the lane: here nothing may be left out for want of torchvision.
# Usage: scripts/test_vision_models.sh [pytest args]   (default: tests/engine/test_vision_language.py)
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${RLOO_VENV:-.venv}"
py="$venv/bin/python"
torch_version=2.14.1
vision_version=0.29.1
overlay="$venv/vision-torch-$torch_version"
if [ ! -f "$overlay/.complete" ]; then
  echo "vision-models: installing torch==$torch_version torchvision==$vision_version into $overlay"
  rm -rf "$overlay"
  "$py" -m pip --disable-pip-version-check install -q --target "$overlay" \
    "torch==$torch_version" "torchvision==$vision_version" 2>&1 | { grep -v "is ignored: it is neither" || true; }
  find "$overlay" -mindepth 1 -maxdepth 1 \
    ! -name 'torch' ! -name 'torch-*' ! -name 'torchvision*' ! -name 'torchgen' ! -name 'functorch' \
    ! -name 'triton*' ! -name 'nvidia*' ! -name 'cuda*' -exec rm -rf {} +
  touch "$overlay/.complete"
fi
export PYTHONPATH="$PWD/$overlay${PYTHONPATH:+:$PYTHONPATH}"
"$py" -c "import sys, torch, torchvision, torchvision.ops; assert torch.__version__.startswith(sys.argv[1]), torch.__version__; print(f'vision-models: torch {torch.__version__}, torchvision {torchvision.__version__}')" "$torch_version"
[ $# -gt 0 ] || set -- tests/engine/test_vision_language.py
log="$(mktemp)"
status=0
"$py" -m pytest -q -rsfE -p no:cacheprovider "$@" 2>&1 | tee "$log" || status=$?
if grep -qE "^[0-9]+ .*skipped" <(tail -1 "$log") || grep -q " skipped" <(tail -1 "$log"); then
  echo "vision-models: tests were skipped; in this lane every vision-language test must run"
  status=1
fi
rm -f "$log"
exit "$status"
