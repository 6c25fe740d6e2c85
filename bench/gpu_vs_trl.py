"""The GPU check's side by side with TRL (bench/gpu_check.sh part 6): TRL's RLOOTrainer and `rloo-engine train` on
the check's ~0.5B Qwen2-shaped policy (bench/gpu_model.py), bf16 autocast, the same data and settings.

    python bench/gpu_vs_trl.py ASSETS_DIR --device cuda --vllm --output vs_trl.json    # on the GPU machine
    .venv-trl/bin/python bench/gpu_vs_trl.py ASSETS_DIR --device cpu                  # the same path on CPU

With `--vllm` both generate with vLLM colocate (TRL: `use_vllm=True, vllm_mode="colocate"`; the engine:
`use_vllm: true`), else both with HF `generate`. Both score with one small reward model built here on the
policy's tokenizer (the policy's cost is what is compared; a 0.5B reward model would double both steps and
the budget). It reuses bench/vs_trl.py's runs and comparison: one round, engine then TRL, each
`--warmup-steps + --steps` optimizer steps; prints one JSON line (s/step, speed-up, peak RSS of each side).
TRL must be importable by this Python (gpu_wheels.sh puts its wheel in .whl/).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "bench")]

import vs_trl  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("assets", type=Path, help="bench/gpu_model.py's output: policy/ and prompts.jsonl")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--vllm", action="store_true", help="both sides generate with vLLM colocate")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--max-completion-length", type=int, default=128)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--warmup-steps", type=int, default=1)
    p.add_argument("--output", type=Path)
    return p.parse_args(argv)


def bench_argv(args: argparse.Namespace, work: Path) -> list[str]:
    engine = []  # fp32 weights (vs_trl's dtype) and bf16 autocast: what TRL's bf16=True runs
    trl = ["use_cpu=false" if args.device == "cuda" else "use_cpu=true", "gradient_checkpointing=false"]
    if args.device == "cuda":
        engine.append("bf16=true")
        trl.append("bf16=true")
    if args.vllm:
        engine += ["use_vllm=true", "vllm_mode=colocate", "vllm_gpu_memory_utilization=0.3"]
        trl += ["use_vllm=true", "vllm_mode=colocate", "vllm_gpu_memory_utilization=0.3"]
    argv = ["--batch", str(args.batch), "--max-completion-length", str(args.max_completion_length),
            "--prompt-length", "512",  # longer than every prompt: neither side truncates (TRL cannot)
            "--steps", str(args.steps), "--warmup-steps", str(args.warmup_steps), "--rounds", "1",
            "--trl-python", sys.executable]
    return argv + [x for o in engine for x in ("--engine-option", o)] + [x for o in trl for x in ("--trl-option", o)]


def main(argv=None) -> int:
    import os

    from transformers import AutoTokenizer

    from rloo_engine.testing import tiny_models

    args = parse_args(argv)
    work = args.assets / "vs_trl"
    work.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(args.assets / "policy")
    reward = tiny_models.build_reward_model(work / "reward", tokenizer, hidden=64, layers=2)
    assets = {"policy": str(args.assets / "policy"), "reward": str(reward),
              "prompts": str(args.assets / "prompts.jsonl")}
    if args.device == "cuda":
        vs_trl.CHILD_ENV.pop("ACCELERATE_USE_CPU", None)
        vs_trl.CHILD_ENV.update(OMP_NUM_THREADS=str(min(8, os.cpu_count() or 1)), MKL_NUM_THREADS="8")
    # TRL's colocated vLLM runs as torch.distributed's rank 0 of 1, as `accelerate launch` would set it
    vs_trl.CHILD_ENV.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29517")
    bench = vs_trl.parse_args(bench_argv(args, work))
    runs = {}
    for side, run in (("engine", vs_trl.run_engine), ("trl", vs_trl.run_trl)):
        side_dir = work / side
        side_dir.mkdir(exist_ok=True)
        runs[side] = [run(bench, assets, side_dir)]
    result = {"device": args.device, "vllm": args.vllm, "batch": args.batch,
              "max_completion_length": args.max_completion_length, **vs_trl.compare(runs),
              "engine_phases": runs["engine"][0]["phases"]}
    line = json.dumps(result)
    print(line)
    if args.output:
        args.output.write_text(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
