#!/usr/bin/env bash
# The one GPU check (under 8 minutes on one H200, nothing from the network): the single_gpu profile in
# bf16 on a random-init ~0.5B Qwen2-shaped policy, the same under ZeRO-3 with one process, then
# bench/engine_throughput.py on CUDA. Prints tokens/s, peak GPU memory and any error for each part.
# Run it through the device tool from the repo root; packages the machine lacks (deepspeed, pydantic,
# datasets, ...) travel as wheels in .whl/ (see bench/README.md).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-/tmp/gpu_check}"
mkdir -p "$out"
py="${PYTHON:-python3}"
if [ -d .whl ]; then
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
"$py" -c 'import torch, transformers, accelerate; print("torch", torch.__version__, "transformers", transformers.__version__, "accelerate", accelerate.__version__)'
"$py" bench/gpu_model.py "$out/assets" || { echo "gpu_check: FAILED building the model"; exit 1; }

train() {  # name, profile, extra flags
  local name=$1 profile=$2; shift 2
  local start=$SECONDS
  timeout 240 "$py" -m accelerate.commands.launch --config_file "deployments/accelerate/$profile.yaml" --num_processes 1 \
    -m rloo_engine train --model_name_or_path "$out/assets/policy" --dataset_name "$out/assets/prompts.jsonl" \
    --reward_funcs rloo_engine.reward_functions:brevity --output_dir "$out/$name" --bf16 \
    --num_generations 4 --per_device_train_batch_size 32 --max_completion_length 128 --beta 0.05 \
    --learning_rate 1e-6 --max_steps 6 --logging_steps 1 --gradient_checkpointing --disable_tqdm "$@" \
    > "$out/$name.log" 2>&1
  local rc=$?
  echo "== $name ($profile): exit $rc after $((SECONDS - start)) s"
  [ $rc -eq 0 ] || { grep -E "Error|error:" "$out/$name.log" | tail -5; return; }
  "$py" - "$out/$name/metrics.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])][1:]  # step 1 includes CUDA warm-up
tok = sum(r["num_tokens"] for r in rows) / sum(r["step_time"] for r in rows)
print(f"   tokens/s (steps 2-6) {tok:,.0f}; s/step {sum(r['step_time'] for r in rows) / len(rows):.2f}; "
      f"reward {rows[-1]['reward']:.3f}; kl {rows[-1]['kl']:.4f}; "
      f"peak GPU memory {max(r.get('memory/max_allocated_gib', float('nan')) for r in rows):.1f} GiB")
PY
}
train single_gpu_bf16 single_gpu
train zero3_one_process deepspeed_zero3
echo "== bench/engine_throughput.py --device cuda"
timeout 180 "$py" bench/engine_throughput.py --device cuda --dtype bfloat16 --hidden 896 --layers 24 --vocab 2000 \
  --batch 64 --steps 4 --output "$out/throughput.json" 2>&1 | tail -25
echo "gpu_check: done"
