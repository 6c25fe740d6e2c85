#!/usr/bin/env bash
# The engine alone, as `pip install rloo-pipeline` gives it: a new venv with the CPU torch wheel and this checkout
# installed without extras (a regular, non-editable install). Checks that none of the pipeline's packages came
# with it, that no top-level `flows` or `tasks` package was installed (a user's own modules of those names stay
# theirs), then trains 2 steps and evaluates with a python judge on tiny assets. CI runs it once (.ci/run, lane 2).
# Usage: scripts/test_engine_install.sh [VENV_DIR]   (default: a new temporary directory, removed at the end)
set -euo pipefail
cd "$(dirname "$0")/.."
repo="$PWD"
work="$(mktemp -d)"
venv="${1:-$work/venv}"
trap 'rm -rf "$work"' EXIT
python="${PYTHON:-python3}"

"$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip --disable-pip-version-check -q)
quiet() { "$@" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }; }
quiet "${pip[@]}" install "torch==2.13.0"
quiet "${pip[@]}" install "$repo"

installed="$("$venv/bin/python" -m pip --disable-pip-version-check list --format freeze 2>/dev/null)"
echo "engine install: $(echo "$installed" | wc -l) packages, $(du -sh "$venv" | cut -f1)"
for pkg in mlflow prefect openai aiohttp matplotlib deepspeed; do
  if echo "$installed" | grep -iq "^$pkg=="; then echo "engine install: FAILED: $pkg was installed"; exit 1; fi
done

cd "$work"
# A user's own `tasks` and `flows` modules are theirs: the install put no packages of those names in site-packages.
echo "WHOSE = 'mine'" > tasks.py
echo "WHOSE = 'mine'" > flows.py
"$venv/bin/python" -c "import tasks, flows; assert tasks.WHOSE == flows.WHOSE == 'mine'"
site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
for name in tasks flows; do
  if [ -e "$site/$name" ]; then echo "engine install: FAILED: $site/$name was installed"; exit 1; fi
done

export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 OMP_NUM_THREADS=1
unset MLFLOW_TRACKING_URI MLFLOW_RUN_ID
"$venv/bin/rloo-engine" tiny-assets assets
"$venv/bin/rloo-engine" train --model_name_or_path assets/policy --dataset_name assets/prompts.jsonl \
  --reward_funcs rloo_engine.reward_functions:char_fraction --num_generations 2 --per_device_train_batch_size 2 \
  --max_completion_length 4 --max_steps 2 --output_dir out --disable_tqdm | tail -7
cat > eval.yaml <<EOF
prompts: assets/prompts.jsonl
max_prompts: 8
pairings: [policy_vs_sft]
policy_model_path: out/final
sft_model_path: assets/policy
generation: {max_new_tokens: 4, dtype: float32, device: cpu}
judge: {backend: python, function: "rloo_engine.demo.toy_task:gold_judge"}
output_dir: eval
EOF
"$venv/bin/rloo-engine" evaluate --config eval.yaml --no_progress | tail -3
test -f eval/results.json
echo "engine install: passed (trained and evaluated without the pipeline's packages)"
