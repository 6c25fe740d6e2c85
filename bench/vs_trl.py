"""Side by side with TRL: TRL's RLOOTrainer and `rloo-engine train` on one locally built model, data and config.

    bash bench/setup_trl_venv.sh          # once: .venv-trl with torch (CPU), this project and TRL
    python bench/vs_trl.py                # both default sizes, 2 rounds of A B (~11-16 min on 2 loaded CPU cores)
    python bench/vs_trl.py --sizes 256x4:2000 --rounds 3 --steps 5
    python bench/vs_trl.py --grid          # 18 cells: vocab 512/32k/152k x 256/4, 512/8 (4x) x prompts 8/64/512

For each model size it builds, in a temporary directory and without downloading anything: a BPE
tokenizer trained on generated text, a random-init Qwen2-shaped policy, a random-init reward model of
the same shape (`AutoModelForSequenceClassification`, num_labels=1) and a prompt file whose prompts
are exactly `--prompt-length` tokens. It then runs each trainer as its own subprocess, alternating
engine, TRL, engine, TRL, ... for `--rounds` rounds, each run `--warmup-steps + --steps` optimizer
steps with one torch thread (OMP_NUM_THREADS=1). It prints, per size, the median s/step of each side
over all measured steps and their ratio (TRL s/step / engine s/step: the engine's speed-up), and the
median peak RSS of each side's process and their ratio (engine / TRL). See bench/README.md, "vs TRL".

s/step is each trainer's own optimizer-step time: the engine's `step_time` from its `metrics.jsonl`,
and, for TRL, the wall time from the HF Trainer's `on_step_begin` to `on_step_end` callback (generation,
scoring and the update all happen inside that window in TRL; logging comes after it, as in the engine).
Peak RSS is `ru_maxrss` of that subprocess alone, from `os.wait4`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_TRL_PYTHON = REPO / ".venv-trl" / "bin" / "python"
SIDES = ("engine", "trl")
CHILD_ENV = {
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "ACCELERATE_USE_CPU": "true",
    "WANDB_DISABLED": "true",
    "PYTHONWARNINGS": "ignore",
}


def parse_size(text: str) -> tuple[int, int, int, int]:
    """`HIDDENxLAYERS:VOCAB[/MULT]` (intermediate = MULT x hidden, default 2), e.g. `512x8:32000/4`."""
    try:
        shape, rest = text.split(":")
        vocab, _, mult = rest.partition("/")
        hidden, layers = shape.split("x")
        return int(hidden), int(layers), int(vocab), int(mult or 2)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}; expected HIDDENxLAYERS:VOCAB[/MULT], e.g. 512x8:32000/4") from None


# vocabulary {512, 32k, 152k} x {hidden 256 / 4 layers, hidden 512 / 8 layers} x intermediate {2x, 4x} hidden
# Issue 47's grid: vocabulary {512, 32k, 152k} x {hidden 256 / 4 layers, hidden 512 / 8 layers}, intermediate 4x hidden
# (issue 20's grid also had 2x: `--sizes 256x4:512/2 ...`), each at prompt lengths 8 / 64 / 512 tokens (where prompt
# sharing pays: each distinct prompt forwarded once, its KV shared by its G completions): 18 cells.
GRID = [(h, n, v, 4) for v in (512, 32000, 152000) for h, n in ((256, 4), (512, 8))]
GRID_PROMPT_LENGTHS = [8, 64, 512]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=parse_size, nargs="+", default=[(256, 4, 2000, 2), (512, 8, 32000, 2)],
                   help="model sizes as HIDDENxLAYERS:VOCAB[/MULT] (intermediate = MULT x hidden, default 2; 4 heads, "
                        "2 KV heads, tied)")
    p.add_argument("--grid", action="store_true",
                   help=f"every shape of the grid instead of --sizes ({len(GRID)}), at each of --prompt-lengths "
                        f"(default with --grid: {GRID_PROMPT_LENGTHS})")
    p.add_argument("--rounds", type=int, default=2, help="rounds of (engine run, TRL run) per size")
    p.add_argument("--steps", type=int, default=3, help="measured optimizer steps per run")
    p.add_argument("--warmup-steps", type=int, default=1, help="optimizer steps run first in each run, not measured")
    p.add_argument("--num-generations", type=int, default=4, help="G, completions per prompt")
    p.add_argument("--batch", type=int, default=16, help="completions per optimizer step (a multiple of G)")
    p.add_argument("--max-completion-length", type=int, default=64)
    p.add_argument("--prompt-length", type=int, default=64, help="tokens in every prompt")
    p.add_argument("--prompt-lengths", type=int, nargs="+", default=None,
                   help="several prompt lengths: every size runs at each (default: --prompt-length; --grid: 8 64 512)")
    p.add_argument("--beta", type=float, default=0.05)
    p.add_argument("--trl-python", type=Path, default=DEFAULT_TRL_PYTHON,
                   help="python of the venv that has TRL (bench/setup_trl_venv.sh)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--engine-option", action="append", default=[], metavar="KEY=VALUE",
                   help="an extra `rloo-engine train` option, e.g. share_prompt_forward=false (a lever off)")
    p.add_argument("--lever-option", action="append", default=[], metavar="KEY=VALUE",
                   help="adds a third run per round, `levers`: the engine with these options on top of --engine-option "
                        "(e.g. generation_dtype=bfloat16), its speed-up and RSS ratio printed beside the default's")
    p.add_argument("--trl-option", action="append", default=[], metavar="KEY=VALUE",
                   help="a TRL RLOOConfig field over the bench's (a JSON value: true, 0.3, \"colocate\"), e.g. "
                        "use_vllm=true on a GPU (bench/gpu_vs_trl.py)")
    p.add_argument("--output", type=Path, default=None, help="also write every number to this JSON file")
    p.add_argument("--trl-worker", type=Path, default=None, help=argparse.SUPPRESS)  # internal: one TRL run
    args = p.parse_args(argv)
    if args.grid:
        args.sizes = GRID
    args.prompt_lengths = args.prompt_lengths or (GRID_PROMPT_LENGTHS if args.grid else [args.prompt_length])
    if args.trl_worker is None:
        if args.batch % args.num_generations:
            p.error(f"--batch: {args.batch} is not a multiple of --num-generations={args.num_generations}")
        if args.rounds < 1 or args.steps < 1 or args.warmup_steps < 0:
            p.error("--rounds and --steps: expected >= 1; --warmup-steps: expected >= 0")
        if not args.trl_python.exists():
            p.error(f"--trl-python: {args.trl_python} does not exist; run `bash bench/setup_trl_venv.sh` first")
    return args


# ---------------------------------------------------------------- assets (project venv)


_TOKENIZERS: dict[tuple[int, int], object] = {}  # (vocab, seed) -> the tokenizer build_assets trained


def build_assets(root: Path, hidden: int, layers: int, vocab: int, mult: int, args: argparse.Namespace) -> dict:
    """Tokenizer, policy, same-shape reward model and a prompt file; returns their paths and sizes."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, Qwen2Config

    from bench.engine_throughput import _stdout_silenced, pseudo_words, sentences
    from rloo_engine.testing.tiny_models import train_tokenizer

    rng = random.Random(args.seed)
    words = pseudo_words(max(4 * vocab, 1000), rng)
    corpus = sentences(words, 20000, 12, rng)  # drawn every time: the prompts below use the rng after it
    if (vocab, args.seed) not in _TOKENIZERS:  # training a 152k BPE takes minutes; the grid has 4 shapes per vocab
        with _stdout_silenced():
            _TOKENIZERS[vocab, args.seed] = train_tokenizer(corpus, vocab_size=vocab)
    tokenizer = _TOKENIZERS[vocab, args.seed]
    # BPE stops early when the corpus runs out of merges; the model's vocabulary is then padded to `vocab`
    # rows (ids the tokenizer never produces), so the LM head and embedding have the requested size.
    model_vocab = max(vocab, len(tokenizer))
    shape = dict(vocab_size=model_vocab, hidden_size=hidden, intermediate_size=mult * hidden, num_hidden_layers=layers,
                 num_attention_heads=4, num_key_value_heads=2,
                 max_position_embeddings=max(512, args.prompt_length + args.max_completion_length),
                 pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                 bos_token_id=tokenizer.eos_token_id, tie_word_embeddings=True)
    import torch

    torch.manual_seed(args.seed)
    policy = AutoModelForCausalLM.from_config(Qwen2Config(**shape))
    policy.generation_config.pad_token_id = tokenizer.pad_token_id
    policy.generation_config.eos_token_id = tokenizer.eos_token_id
    policy.save_pretrained(root / "policy")
    tokenizer.save_pretrained(root / "policy")
    torch.manual_seed(args.seed + 1)
    reward = AutoModelForSequenceClassification.from_config(Qwen2Config(**shape, num_labels=1))
    reward.save_pretrained(root / "reward")
    tokenizer.save_pretrained(root / "reward")
    params = sum(t.numel() for t in policy.parameters())
    heads = shape["num_attention_heads"]
    arithmetic_shape = {"hidden": hidden, "layers": layers, "intermediate": mult * hidden, "heads": heads,
                        "kv_heads": shape["num_key_value_heads"], "head_dim": hidden // heads, "vocab": model_vocab}

    # Prompts of exactly `prompt_length` tokens whose text re-tokenizes to the same length, so that neither
    # trainer truncates (TRL 1.x has no max_prompt_length) and both see identical prompt tokens.
    prompts = []
    for text in sentences(words, 512, args.prompt_length, rng):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"][: args.prompt_length]
        cut = tokenizer.decode(ids)
        if len(tokenizer(cut, add_special_tokens=False)["input_ids"]) == args.prompt_length:
            prompts.append(cut)
    if len(prompts) < 64:
        raise SystemExit(f"prompts: only {len(prompts)} of 512 re-tokenize to {args.prompt_length} tokens; expected >= 64")
    (root / "prompts.jsonl").write_text("".join(json.dumps({"prompt": t}) + "\n" for t in prompts))
    return {"policy": str(root / "policy"), "reward": str(root / "reward"), "prompts": str(root / "prompts.jsonl"),
            "tokenizer_vocab": len(tokenizer), "model_vocab": model_vocab, "params": params, "shape": arithmetic_shape}


# ---------------------------------------------------------------- one run of each side


def run_child(command: list[str], log: Path) -> dict:
    """Runs `command` with one thread; returns its wall time and peak RSS (that process alone, os.wait4)."""
    env = {**os.environ, **CHILD_ENV}
    for var in ("MLFLOW_TRACKING_URI", "MLFLOW_RUN_ID", "MLFLOW_EXPERIMENT_NAME"):  # a bench run is not an experiment
        env.pop(var, None)
    started = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO)
        _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        tail = "\n".join(log.read_text().splitlines()[-25:])
        raise SystemExit(f"{command[0]} ... exited {proc.returncode}; last lines of {log}:\n{tail}")
    return {"wall_s": time.perf_counter() - started, "peak_rss_mib": usage.ru_maxrss / 1024}  # Linux: KiB


def common_settings(args: argparse.Namespace, assets: dict, output_dir: Path) -> dict:
    """The settings both sides get, under the names both use (TRL's)."""
    return {
        "output_dir": str(output_dir),
        "per_device_train_batch_size": args.batch,
        "gradient_accumulation_steps": 1,
        "steps_per_generation": 1,
        "num_generations": args.num_generations,
        "max_completion_length": args.max_completion_length,
        "beta": args.beta,
        "num_iterations": 1,
        "learning_rate": 1e-5,
        "max_steps": args.warmup_steps + args.steps,
        "logging_steps": 1,
        "seed": args.seed,
        "temperature": 1.0,
    }


def sides(args: argparse.Namespace) -> tuple[str, ...]:
    return ("engine", "levers", "trl") if args.lever_option else SIDES


def run_engine(args: argparse.Namespace, assets: dict, work: Path, levers: bool = False) -> dict:
    out = work / "engine-out"
    flags = {**common_settings(args, assets, out), "model_name_or_path": assets["policy"],
             "reward_model_name_or_path": assets["reward"], "dataset_name": assets["prompts"],
             "max_prompt_length": args.prompt_length, "dtype": "float32", "save_steps": 0, "disable_tqdm": "true",
             **engine_options(args.engine_option),
             **(engine_options(args.lever_option, "--lever-option") if levers else {})}
    command = [sys.executable, "-m", "rloo_engine", "train"]
    for key, value in flags.items():
        command += [f"--{key}", str(value)]
    usage = run_child(command, work / "engine.log")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    measured = [r for r in rows if r["step"] > args.warmup_steps]
    if len(measured) != args.steps:
        raise SystemExit(f"engine metrics.jsonl: {len(measured)} measured steps; expected {args.steps}")
    timed = [k for k in measured[0] if k.startswith("timing/") and k.endswith("_s")]
    phases = {k.removeprefix("timing/").removesuffix("_s"): statistics.mean(r[k] for r in measured) for k in timed}
    return {**usage, "step_s": [r["step_time"] for r in measured], "phases": phases,
            "completion_length": statistics.mean(r["completions/mean_length"] for r in measured)}


def run_trl(args: argparse.Namespace, assets: dict, work: Path) -> dict:
    spec = work / "trl-spec.json"
    spec.write_text(json.dumps({"settings": common_settings(args, assets, work / "trl-out"), "assets": assets,
                                "overrides": dict(_json_option(o) for o in args.trl_option),
                                "steps_file": str(work / "trl-steps.jsonl")}))
    usage = run_child([str(args.trl_python), str(Path(__file__).resolve()), "--trl-worker", str(spec)],
                      work / "trl.log")
    rows = [json.loads(line) for line in (work / "trl-steps.jsonl").read_text().splitlines()]
    measured = [r for r in rows if r.get("step", 0) > args.warmup_steps]
    if len(measured) != args.steps:
        raise SystemExit(f"TRL steps: {len(measured)} measured steps; expected {args.steps}")
    lengths = [r["completion_length"] for r in rows if r.get("log_step", 0) > args.warmup_steps]
    return {**usage, "step_s": [r["step_s"] for r in measured],
            "completion_length": statistics.mean(lengths) if lengths else None}


def engine_options(pairs: list[str], flag: str = "--engine-option") -> dict[str, str]:
    """KEY=VALUE `rloo-engine train` settings as {KEY: VALUE}. A pair without `=` or a KEY that is no RLOOConfig
    field stops the bench at once, before assets are built or any run starts."""
    from rloo_engine.config import RLOOConfig

    options = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or key not in RLOOConfig.model_fields:
            why = "expected KEY=VALUE" if not sep else f"{key!r} is not an rloo-engine train setting (RLOOConfig)"
            sys.exit(f"{flag} {pair!r}: {why}, e.g. share_prompt_forward=false")
        options[key] = value
    return options


def _json_option(option: str) -> tuple[str, object]:
    key, _, text = option.partition("=")
    try:
        return key, json.loads(text)
    except json.JSONDecodeError:
        return key, text  # a bare string


def trl_worker(spec_path: Path) -> int:
    """Inside .venv-trl: one TRL RLOOTrainer run; each optimizer step's time goes to `steps_file`."""
    import torch
    import transformers
    from datasets import load_dataset
    from transformers import TrainerCallback
    from trl import RLOOConfig, RLOOTrainer

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    transformers.logging.set_verbosity_error()
    spec = json.loads(spec_path.read_text())
    settings, assets = spec["settings"], spec["assets"]
    config = RLOOConfig(**{
        **settings,
        "bf16": False,
        "fp16": False,
        "use_cpu": True,
        "gradient_checkpointing": False,  # TRL's default is True; the engine's is False
        "disable_dropout": True,  # the engine's default
        "save_strategy": "no",
        "eval_strategy": "no",
        "report_to": "none",
        "disable_tqdm": True,
        "use_vllm": False,
        "dataloader_num_workers": 0,
        **spec.get("overrides", {}),  # --trl-option
    })
    dataset = load_dataset("json", data_files=assets["prompts"], split="train")
    steps_file = open(spec["steps_file"], "w")

    class StepTimer(TrainerCallback):
        """Wall time of each optimizer step, from the Trainer's own step callbacks; the logged mean length."""

        def on_step_begin(self, args, state, control, **kwargs):
            self.started = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            steps_file.write(json.dumps({"step": state.global_step, "step_s": time.perf_counter() - self.started}) + "\n")

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "completions/mean_length" in logs:
                steps_file.write(json.dumps({"log_step": state.global_step,
                                             "completion_length": logs["completions/mean_length"]}) + "\n")

    trainer = RLOOTrainer(model=assets["policy"], reward_funcs=assets["reward"], args=config, train_dataset=dataset,
                          callbacks=[StepTimer()])
    trainer.train()
    steps_file.close()  # flushes the rows written by the callbacks
    return 0


# ---------------------------------------------------------------- report


def compare(results: dict[str, list[dict]]) -> dict:
    engine_s = statistics.median(s for run in results["engine"] for s in run["step_s"])
    trl_s = statistics.median(s for run in results["trl"] for s in run["step_s"])
    engine_rss = statistics.median(run["peak_rss_mib"] for run in results["engine"])
    trl_rss = statistics.median(run["peak_rss_mib"] for run in results["trl"])
    out = {"engine_s_per_step": engine_s, "trl_s_per_step": trl_s, "speedup": trl_s / engine_s,
           "engine_peak_rss_mib": engine_rss, "trl_peak_rss_mib": trl_rss, "rss_ratio": engine_rss / trl_rss}
    if "levers" in results:
        levers_s = statistics.median(s for run in results["levers"] for s in run["step_s"])
        levers_rss = statistics.median(run["peak_rss_mib"] for run in results["levers"])
        out.update(levers_s_per_step=levers_s, levers_speedup=trl_s / levers_s, levers_peak_rss_mib=levers_rss,
                   levers_rss_ratio=levers_rss / trl_rss)
    return out


def accounting(size: dict, args: argparse.Namespace, side: str = "engine") -> dict:
    """Each engine phase's model FLOPs (bench/flops.py) against its measured time and this cell's float32 matmul
    peak; generation also against the decode ceiling; TRL's step likewise, and the FLOP ratio of the two steps."""
    from bench import flops

    shape = flops.Shape(**size["assets"]["shape"])
    peak, ceiling = size["peak_flop_per_s"], size["decode_ceiling_flop_per_s"]
    engine_runs, trl_runs = size["runs"][side], size["runs"]["trl"]
    length = statistics.mean(run["completion_length"] for run in engine_runs)
    tokens = flops.Tokens(args.batch, args.num_generations, size["prompt_length"], length * args.batch)
    reference_forwards = 0 if not args.beta else 2 if "sampling_logprobs=forward" in args.engine_option else 1
    work = flops.engine_phases(shape, tokens, reference_forwards)
    step_s = statistics.mean(s for run in engine_runs for s in run["step_s"])
    phases = {}
    for name, seconds in ((p, statistics.mean(run["phases"].get(p, 0.0) for run in engine_runs)) for p in work):
        phases[name] = {"seconds": seconds, "gflop": work[name] / 1e9,
                        "of_peak": work[name] / seconds / peak if seconds else None}
    phases["other"] = {"seconds": step_s - sum(p["seconds"] for p in phases.values()), "gflop": 0.0, "of_peak": None}
    engine_flops = sum(work.values())
    trl_lengths = [run["completion_length"] for run in trl_runs if run["completion_length"] is not None]
    trl_tokens = flops.Tokens(args.batch, args.num_generations, size["prompt_length"],
                              (statistics.mean(trl_lengths) if trl_lengths else length) * args.batch)
    trl_flops = sum(flops.trl_phases(shape, trl_tokens, args.beta).values())
    trl_step_s = statistics.mean(s for run in trl_runs for s in run["step_s"])
    generation = phases["generation"]
    return {
        "batch": args.batch, "peak_gflop_per_s": peak / 1e9, "decode_ceiling_gflop_per_s": ceiling / 1e9, "phases": phases,
        "generation_of_decode_ceiling": work["generation"] / generation["seconds"] / ceiling if generation["seconds"] else None,
        "engine_gflop_per_step": engine_flops / 1e9, "engine_of_peak": engine_flops / step_s / peak,
        "trl_gflop_per_step": trl_flops / 1e9, "trl_of_peak": trl_flops / trl_step_s / peak,
        # TRL's step over the engine's at the same tokens: the speed-up if both ran at the same fraction of peak
        "flop_ratio": sum(flops.trl_phases(shape, tokens, args.beta).values()) / engine_flops,
    }


def print_accounting(a: dict) -> None:
    print(f"  arithmetic: float32 matmul peak {a['peak_gflop_per_s']:.1f} GFLOP/s (this run, one thread); a decode "
          f"step's matmuls at {a['batch']} rows, weights from memory: {a['decode_ceiling_gflop_per_s']:.1f} "
          f"GFLOP/s ({a['decode_ceiling_gflop_per_s'] / a['peak_gflop_per_s']:.0%} of peak)")
    for name, p in a["phases"].items():
        of_peak = f"{p['of_peak']:6.1%} of peak" if p["of_peak"] is not None else f"{'-':>6}"
        extra = (f" ({a['generation_of_decode_ceiling']:.0%} of the decode ceiling)"
                 if name == "generation" and a["generation_of_decode_ceiling"] is not None else "")
        print(f"    {name:<14}{p['seconds']:7.2f} s {p['gflop']:8.1f} GFLOP  {of_peak}{extra}")
    print(f"    {'step':<14}{'':9}{a['engine_gflop_per_step']:8.1f} GFLOP  {a['engine_of_peak']:6.1%} of peak;  TRL "
          f"{a['trl_gflop_per_step']:.1f} GFLOP at {a['trl_of_peak']:.1%} of peak; TRL's work / the engine's = "
          f"{a['flop_ratio']:.2f} (the speed-up at equal efficiency; 1.5x needs the engine at "
          f"{1.5 / a['flop_ratio'] * a['trl_of_peak']:.0%} of peak)")


def print_size(size: dict, args: argparse.Namespace) -> None:
    a, c = size["assets"], size["comparison"]
    padded = (f", padded to {a['model_vocab']} in the model" if a["model_vocab"] > a["tokenizer_vocab"] else "")
    print(f"model     qwen2, hidden {size['hidden']}, {size['layers']} layers, intermediate {size['intermediate']}, "
          f"vocab {a['model_vocab']}, prompts {size['prompt_length']} tok "
          f"(tokenizer {a['tokenizer_vocab']}{padded}): {a['params'] / 1e6:.1f}M params; reward model same shape")
    print(f"load      1-min load average {size['load_before']:.2f} before, {size['load_after']:.2f} after"
          f"{'  << machine loaded (> 1.5): times inflated' if max(size['load_before'], size['load_after']) > 1.5 else ''}")
    for side in sides(args):
        runs = size["runs"][side]
        steps = " ".join(f"{s:.2f}" for run in runs for s in run["step_s"])
        rss = " ".join(f"{run['peak_rss_mib']:.0f}" for run in runs)
        lengths = [run["completion_length"] for run in runs if run["completion_length"] is not None]
        length = f"{statistics.mean(lengths):.1f}" if lengths else "-"
        print(f"  {side:<7} s/step per measured step: {steps}   peak RSS MiB per run: {rss}   "
              f"mean completion tok: {length}")
    engine_runs = size["runs"]["engine"]
    phases = {p: statistics.mean(run["phases"][p] for run in engine_runs) for p in engine_runs[0]["phases"]}
    print("  engine phases (mean s/step): " + ", ".join(f"{p} {s:.2f}" for p, s in sorted(phases.items())))
    rounds = zip(size["runs"]["engine"], size["runs"]["trl"])
    print("  speed-up per round (TRL / engine median s/step): "
          + " ".join(f"{statistics.median(t['step_s']) / statistics.median(e['step_s']):.2f}" for e, t in rounds))
    print(f"  median s/step: engine {c['engine_s_per_step']:.2f}, TRL {c['trl_s_per_step']:.2f}  ->  "
          f"engine speed-up {c['speedup']:.2f}x TRL steps/s")
    print(f"  median peak RSS: engine {c['engine_peak_rss_mib']:.0f} MiB, TRL {c['trl_peak_rss_mib']:.0f} MiB  ->  "
          f"engine/TRL {c['rss_ratio']:.2f}")
    if "levers" in size["runs"]:
        print(f"  levers ({' '.join(args.lever_option)}): median s/step {c['levers_s_per_step']:.2f} -> "
              f"{c['levers_speedup']:.2f}x TRL steps/s; peak RSS {c['levers_peak_rss_mib']:.0f} MiB -> "
              f"{c['levers_rss_ratio']:.2f}x TRL's")
    print_accounting(size["accounting"])
    if "levers" in size["runs"]:
        print("  levers:")
        print_accounting(size["levers_accounting"])
    print()


def print_table(sizes: list[dict]) -> None:
    """Every cell in one table, worst speed-up first, then the arithmetic of each in the same order, then the worst and
    the best cell (a headline quotes both)."""
    sizes = sorted(sizes, key=lambda z: z["comparison"]["speedup"])
    levers = "levers_speedup" in sizes[0]["comparison"]
    print("| shape (hidden, layers, intermediate, vocab) | prompt tok | params | TRL s/step | engine s/step | speed "
          "| peak RSS ratio | load before/after |" + (" levers s/step | levers speed | levers RSS ratio |" if levers else ""))
    print("|---|---|---|---|---|---|---|---|" + ("---|---|---|" if levers else ""))
    for z in sizes:
        a, c = z["assets"], z["comparison"]
        levers = (f" {c['levers_s_per_step']:.2f} | **{c['levers_speedup']:.2f}x** | {c['levers_rss_ratio']:.2f}x |"
                  if "levers_speedup" in c else "")
        print(f"| {z['hidden']}, {z['layers']}, {z['intermediate']}, {a['model_vocab']:,} | {z['prompt_length']} "
              f"| {a['params'] / 1e6:.1f}M "
              f"| {c['trl_s_per_step']:.2f} | {c['engine_s_per_step']:.2f} | **{c['speedup']:.2f}x** "
              f"| **{c['rss_ratio']:.2f}x** | {z['load_before']:.2f} / {z['load_after']:.2f} |{levers}")
    print("\nThe arithmetic of each cell (bench/flops.py): the engine's phases as a fraction of the float32 matmul peak "
          "measured before the cell; generation also of the decode ceiling (its matmuls at this batch, weights from "
          "memory); TRL's step; TRL's FLOPs / the engine's (the speed-up at equal efficiency)\n")
    print("| cell (hidden, layers, vocab, prompt tok) | peak GFLOP/s | generation (of ceiling) | reward | reference "
          "| update | engine step | TRL step | TRL/engine FLOPs |")
    print("|---|---|---|---|---|---|---|---|---|")
    for z in sizes:
        a = z["accounting"]
        ph = {k: f"{v['of_peak']:.0%}" if v["of_peak"] is not None else "-" for k, v in a["phases"].items()}
        gen = a["generation_of_decode_ceiling"]
        print(f"| {z['hidden']}, {z['layers']}, {z['assets']['model_vocab']:,}, {z['prompt_length']} "
              f"| {a['peak_gflop_per_s']:.0f} | {ph['generation']} ({gen:.0%} of {a['decode_ceiling_gflop_per_s']:.0f}) "
              f"| {ph['reward']} | {ph['reference']} | {ph['policy_update']} | {a['engine_of_peak']:.0%} "
              f"| {a['trl_of_peak']:.0%} | {a['flop_ratio']:.2f} |")
    print()
    worst = min(sizes, key=lambda z: z["comparison"]["speedup"])
    best = max(sizes, key=lambda z: z["comparison"]["speedup"])
    for name, z in (("worst", worst), ("best", best)):
        print(f"{name} cell: {z['hidden']}x{z['layers']}, intermediate {z['intermediate']}, vocab "
              f"{z['assets']['model_vocab']}, prompts {z['prompt_length']} tok: {z['comparison']['speedup']:.2f}x TRL steps/s, "
              f"{z['comparison']['rss_ratio']:.2f}x its peak RSS")
    if levers:
        worst = min(sizes, key=lambda z: z["comparison"]["levers_speedup"])
        print(f"worst cell with the levers: {worst['hidden']}x{worst['layers']}, vocab {worst['assets']['model_vocab']}, "
              f"prompts {worst['prompt_length']} tok: {worst['comparison']['levers_speedup']:.2f}x TRL steps/s, "
              f"{worst['comparison']['levers_rss_ratio']:.2f}x its peak RSS")


def trl_version(python: Path) -> str:
    return subprocess.run([str(python), "-c", "import trl, torch; print(trl.__version__, torch.__version__)"],
                          capture_output=True, text=True, check=True).stdout.strip()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.trl_worker is not None:
        return trl_worker(args.trl_worker)
    sys.path.insert(0, str(REPO))
    engine_options(args.engine_option)  # a bad option stops here, before any tokenizer is trained
    engine_options(args.lever_option, "--lever-option")
    import torch
    import transformers

    from bench import flops

    torch.set_num_threads(1)  # the peak and the decode ceiling are measured on one thread, as each run has
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    trl_ver, torch_ver = trl_version(args.trl_python).split()
    commit = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=REPO, capture_output=True,
                            text=True).stdout.strip() or "unknown"
    print(f"rloo-engine vs TRL (bench/vs_trl.py, commit {commit}, "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})")
    print(f"TRL {trl_ver}, torch {torch_ver}; {os.cpu_count()} CPUs, one torch thread per run (OMP_NUM_THREADS=1)")
    print(f"config    {args.batch} completions/step = {args.batch // args.num_generations} prompts x "
          f"G={args.num_generations}; prompts of {'/'.join(map(str, args.prompt_lengths))} tok, "
          f"<= {args.max_completion_length} new tok; "
          f"beta {args.beta}; float32; reward: same-shape reward model")
    print(f"runs      {args.rounds} rounds of engine, TRL (alternating); each {args.warmup_steps} warmup + "
          f"{args.steps} measured steps; s/step = each trainer's own optimizer-step time; RSS = ru_maxrss per process\n")
    sizes = []
    cells = [(size, length) for size in args.sizes for length in args.prompt_lengths]
    for (hidden, layers, vocab, mult), prompt_length in cells:
        args.prompt_length = prompt_length  # build_assets and both runs read it
        with tempfile.TemporaryDirectory(prefix="rloo-vs-trl-") as tmp:
            root = Path(tmp)
            assets = build_assets(root, hidden, layers, vocab, mult, args)
            load_before = os.getloadavg()[0]
            # Measured in this process (one thread, as each run has) just before the cell's runs.
            peak = flops.matmul_peak()
            ceiling = flops.decode_matmul_ceiling(flops.Shape(**assets["shape"]), args.batch)
            runs: dict[str, list[dict]] = {side: [] for side in sides(args)}
            for round_ in range(args.rounds):
                for side in sides(args):
                    work = root / f"{side}-{round_}"
                    work.mkdir()
                    run = (run_trl(args, assets, work) if side == "trl"
                           else run_engine(args, assets, work, levers=side == "levers"))
                    runs[side].append(run)
            size = {"hidden": hidden, "layers": layers, "intermediate": mult * hidden, "prompt_length": prompt_length,
                    "assets": assets, "runs": runs,
                    "load_before": load_before, "load_after": os.getloadavg()[0], "comparison": compare(runs),
                    "peak_flop_per_s": peak, "decode_ceiling_flop_per_s": ceiling}
            size["accounting"] = accounting(size, args)
            if "levers" in runs:
                size["levers_accounting"] = accounting(size, args, "levers")
        print_size(size, args)
        sizes.append(size)
    print_table(sizes)
    if args.output:
        args.output.write_text(json.dumps({"commit": commit, "trl": trl_ver, "torch": torch_ver, "args": {
            k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}, "sizes": sizes}, indent=2) + "\n")
        print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
