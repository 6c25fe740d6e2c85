#!/usr/bin/env bash
# The engine tests on another transformers release than the venv's: by default the oldest pyproject.toml allows,
# so a keyword or an API that only newer releases have cannot come back unnoticed (5.23 and older call the KV
# cache `past_key_values`, 5.24 calls it `cache`). CI runs it beside scripts/test.sh (.ci/run's lane 2).
#
# The release and the huggingface_hub it needs (<2) go into an overlay directory inside the venv, put first on
# PYTHONPATH; every other package is the main venv's. Installing an overlay takes a few seconds.
# Usage: scripts/test_engine_on_transformers.sh [--version X.Y.Z] [pytest args]
# Defaults: the oldest release, and, when no pytest argument names a test path (options alone, e.g. --durations=20,
# run them too), the engine test files that call transformers in process (the `run` lines of
# scripts/engine_tests_on_oldest_transformers.txt); the rest test what no transformers release changes, and the main
# suite runs them on the newest. `tests/engine` as the pytest argument runs them all.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${RLOO_VENV:-.venv}"
py="$venv/bin/python"
version=""
if [ "${1:-}" = "--version" ]; then version=$2; shift 2; fi
oldest=$("$py" - <<'PY'
import re, tomllib
deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
(spec,) = [d for d in deps if re.match(r"transformers\b", d)]
print(re.search(r">=\s*([\w.]+)", spec).group(1))
PY
)
version="${version:-$oldest}"
overlay="$venv/transformers-$version"
if [ ! -f "$overlay/.complete" ]; then
  echo "engine-on-transformers: installing transformers==$version and huggingface-hub<2 into $overlay"
  rm -rf "$overlay"
  "$py" -m pip --disable-pip-version-check install -q --no-deps --target "$overlay" \
    "transformers==$version" "huggingface-hub>=1.31,<2" 2>&1 | { grep -v "is ignored: it is neither" || true; }
  touch "$overlay/.complete"
fi
export PYTHONPATH="$PWD/$overlay${PYTHONPATH:+:$PYTHONPATH}"
"$py" -c "import sys, transformers, huggingface_hub as h; assert transformers.__version__ == sys.argv[1], transformers.__version__; print(f'engine-on-transformers: transformers {transformers.__version__}, huggingface_hub {h.__version__}')" "$version"
named_path=0
for arg in "$@"; do
  if [[ "$arg" != -* && -e "${arg%%::*}" ]]; then named_path=1; fi
done
[ "$named_path" -eq 1 ] || set -- "$@" $(awk '$1 == "run" {print $2}' scripts/engine_tests_on_oldest_transformers.txt)
exec "$py" -m pytest -q -rsfE -p no:cacheprovider "$@"
