#!/usr/bin/env bash
# Builds the wheels the GPU machine lacks into .whl/ (git-ignored), for Python 3.12 on manylinux x86_64: the
# device image has torch and transformers but no network and no pydantic, datasets or deepspeed. The versions are
# the ones this checkout's .venv runs (so the device runs what the tests ran). Fails loudly when a wheel is
# missing. Then: run the device command in bench/README.md ("GPU check"), which carries `.whl`.
# Usage: bash bench/gpu_wheels.sh [DEST]   (default .whl)
set -euo pipefail
cd "$(dirname "$0")/.."
dest="${1:-.whl}"
venv="${RLOO_VENV:-.venv}"
py="$venv/bin/python"
pyver="${GPU_PYTHON_VERSION:-3.12}"
platform="${GPU_PLATFORM:-manylinux_2_28_x86_64}"

# What the device lacks: pydantic and its deps, datasets and the deps the image does not have, deepspeed's
# pure-Python deps. Each is pinned to the version installed here.
packages=(pydantic pydantic-core annotated-types typing-inspection typing-extensions datasets dill multiprocess xxhash
          hjson msgpack ninja py-cpuinfo einops)
pins=()
for name in "${packages[@]}"; do
  version=$("$py" -c 'import sys; from importlib.metadata import version; print(version(sys.argv[1]))' "$name") \
    || { echo "gpu_wheels: $name is not installed in $venv; run scripts/setup.sh first" >&2; exit 1; }
  pins+=("$name==$version")
done
deepspeed=$("$py" -c 'from importlib.metadata import version; print(version("deepspeed"))')
# TRL for gpu_check.sh part 6 (bench/gpu_vs_trl.py): the version bench/vs_trl.py runs, pure Python.
pins+=("$(grep -E '^trl==' bench/requirements-trl.txt)")

rm -rf "$dest"
mkdir -p "$dest"
quiet() { "$@" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }; }
echo "gpu_wheels: downloading ${pins[*]} for Python $pyver ($platform)"
quiet "$py" -m pip --disable-pip-version-check download -q --no-deps --only-binary=:all: \
  --python-version "$pyver" --implementation cp --platform "$platform" --platform manylinux2014_x86_64 \
  --platform any -d "$dest" "${pins[@]}"
# DeepSpeed publishes only an sdist; built here it is a pure-Python wheel (its ops compile at run time, and
# ZeRO-3 with torch's AdamW needs none). Its build imports the installed torch, hence no build isolation.
echo "gpu_wheels: building deepspeed==$deepspeed (pure Python)"
quiet "$py" -m pip --disable-pip-version-check wheel -q --no-deps --no-build-isolation -w "$dest" "deepspeed==$deepspeed"

missing=()
for pin in "${pins[@]}" "deepspeed==$deepspeed"; do
  stem=$(echo "${pin%%==*}" | tr '-' '_')
  version=${pin##*==}
  compgen -G "$dest/${stem}-${version}-*.whl" >/dev/null || missing+=("$pin")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "gpu_wheels: FAILED: no wheel for ${missing[*]} in $dest" >&2
  exit 1
fi
du -sh "$dest" | awk -v n="$(ls "$dest" | wc -l)" '{print "gpu_wheels: " n " wheels, " $1 " in " $2}'
