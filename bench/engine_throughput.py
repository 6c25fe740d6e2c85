"""Benchmarks one RLOOTrainer run: time per phase, tokens/s, peak memory, model FLOP/s against a matmul peak.

    python bench/engine_throughput.py                        # the default small config, ~1-2 min on 2 CPU cores
    python bench/engine_throughput.py --hidden 512 --layers 8 --device cuda --output result.json

Everything is built in a temporary directory (a BPE tokenizer trained on generated text, a random-init
Qwen2-shaped model, a prompt file) and trained with the real `RLOOTrainer` for `warmup + steps`
optimizer steps, logging every step; the warmup steps are dropped from `metrics.jsonl` before
averaging. In the same process it then measures a dense matmul peak and a generation baseline
(shared prefill vs `num_return_sequences`), so every ratio compares numbers from one machine state.
See bench/README.md for what each number means.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import resource
import statistics
import sys
import tempfile
import time
import warnings
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
for _var in ("MLFLOW_TRACKING_URI", "MLFLOW_RUN_ID"):  # a benchmark run is not an experiment to track
    os.environ.pop(_var, None)

import torch

from rloo_engine.config import RLOOConfig
from rloo_engine.generation.base import SamplingParams
from rloo_engine.generation.hf import HFGenerationBackend
from rloo_engine.testing.tiny_models import build_causal_lm, train_tokenizer

PHASES = ("generation", "reward", "reference", "policy_update")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
MAX_POSITIONS = 512  # max_position_embeddings of the models `tiny_models` builds


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=256, help="model hidden size (intermediate = 2x)")
    p.add_argument("--layers", type=int, default=4, help="decoder layers")
    p.add_argument("--vocab", type=int, default=2000, help="BPE tokenizer vocabulary size")
    p.add_argument("--num-generations", type=int, default=4, help="G, completions per prompt")
    p.add_argument("--batch", type=int, default=16, help="completions per optimizer step (a multiple of G)")
    p.add_argument("--max-completion-length", type=int, default=64, help="max new tokens per completion")
    p.add_argument("--prompt-length", type=int, default=64, help="prompt tokens in training (all exactly this long)")
    p.add_argument("--steps", type=int, default=10, help="measured optimizer steps")
    p.add_argument("--warmup-steps", type=int, default=2, help="optimizer steps run first and left out of the averages")
    p.add_argument("--beta", type=float, default=0.05, help="KL coefficient; > 0 adds the reference forward")
    p.add_argument("--sampling-logprobs", choices=("auto", "generation", "forward"), default="auto",
                   help="the trainer's sampling_logprobs: `forward` adds a policy forward for the KL")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="float32", help="weight dtype, also the matmul peak's")
    p.add_argument("--baseline-prompt-length", type=int, default=256, help="prompt tokens in the generation baseline")
    p.add_argument("--baseline-calls", type=int, default=3, help="timed generation calls per method (median reported)")
    p.add_argument("--peak-size", type=int, default=2048, help="n of the n x n matmul that measures peak FLOP/s")
    p.add_argument("--peak-seconds", type=float, default=2.0, help="how long the matmul peak is measured")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", type=Path, default=None, help="also write every result to this JSON file")
    args = p.parse_args(argv)
    _validate(p, args)
    return args


def _validate(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    if a.num_generations < 2:
        p.error(f"--num-generations: {a.num_generations}; RLOO needs at least 2")
    if a.batch % a.num_generations:
        p.error(f"--batch: {a.batch} is not a multiple of --num-generations={a.num_generations}")
    for name in ("hidden", "layers", "vocab", "steps", "max_completion_length", "prompt_length",
                 "baseline_prompt_length", "baseline_calls", "peak_size"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')}: {getattr(a, name)}; expected >= 1")
    if a.hidden % 4:
        p.error(f"--hidden: {a.hidden}; expected a multiple of 4 (the models have 4 attention heads)")
    if a.warmup_steps < 0:
        p.error(f"--warmup-steps: {a.warmup_steps}; expected >= 0")
    for name in ("prompt_length", "baseline_prompt_length"):
        if getattr(a, name) + a.max_completion_length > MAX_POSITIONS:
            p.error(f"--{name.replace('_', '-')} + --max-completion-length = "
                    f"{getattr(a, name) + a.max_completion_length}; the models hold at most {MAX_POSITIONS} positions")
    if a.device == "cuda" and not torch.cuda.is_available():
        p.error("--device: cuda, but torch.cuda.is_available() is False")


# ---------------------------------------------------------------- assets


def pseudo_words(count: int, rng: random.Random) -> list[str]:
    """`count` distinct made-up words, so a BPE tokenizer has enough material to reach a large vocabulary."""
    syllables = [c + v for c in "bcdfghjklmnprstvwz" for v in "aeiou"]
    words: set[str] = set()
    while len(words) < count:
        words.add("".join(rng.choice(syllables) for _ in range(rng.randint(1, 4))))
    return sorted(words)


def sentences(words: list[str], num: int, length: int, rng: random.Random) -> list[str]:
    """`num` lines of exactly `length` words, Zipf-weighted so frequent words become single tokens."""
    # The cumulative weights once, not per line (`choices(words, weights)` accumulates them at every call: 20,000
    # lines over a 608k-word list took ~20 minutes); the same draws from the same random numbers either way.
    cumulative = list(itertools.accumulate(1.0 / (rank + 1) for rank in range(len(words))))
    return [" ".join(rng.choices(words, cum_weights=cumulative, k=length)) for _ in range(num)]


@contextmanager
def _stdout_silenced():
    """Silences file descriptor 1: the Rust tokenizer trainer prints blank progress lines straight to it."""
    sys.stdout.flush()
    saved = os.dup(1)
    with open(os.devnull, "w") as devnull:
        os.dup2(devnull.fileno(), 1)
        try:
            yield
        finally:
            os.dup2(saved, 1)
            os.close(saved)


def build_assets(root: Path, args: argparse.Namespace):
    """Tokenizer, model dir and prompt file; every prompt has at least `prompt_length` tokens (truncated to it)."""
    rng = random.Random(args.seed)
    words = pseudo_words(max(4 * args.vocab, 1000), rng)
    with _stdout_silenced():
        tokenizer = train_tokenizer(sentences(words, 20000, 12, rng), vocab_size=args.vocab)
    model_dir = build_causal_lm(root / "policy", tokenizer, arch="qwen2", hidden=args.hidden,
                                layers=args.layers, seed=args.seed)
    # One word is at least one token, so `length` words give at least `length` tokens; the trainer's
    # left truncation (`max_prompt_length`) then makes every prompt exactly `length` tokens.
    prompts = sentences(words, 256, args.prompt_length, rng)
    baseline_prompts = sentences(words, args.batch // args.num_generations, args.baseline_prompt_length, rng)
    for texts, length in ((prompts, args.prompt_length), (baseline_prompts, args.baseline_prompt_length)):
        shortest = min(len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"])
        if shortest < length:
            raise SystemExit(f"bench prompts: shortest has {shortest} tokens; expected >= {length}")
    prompt_file = root / "prompts.jsonl"
    prompt_file.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in prompts))
    return tokenizer, model_dir, prompt_file, baseline_prompts


def bench_config(args: argparse.Namespace, model_dir: Path, prompt_file: Path, output_dir: Path) -> RLOOConfig:
    return RLOOConfig(
        model_name_or_path=str(model_dir),
        dataset_name=str(prompt_file),
        reward_funcs=["rloo_engine.reward_functions:char_fraction"],
        output_dir=str(output_dir),
        dtype=args.dtype,
        num_generations=args.num_generations,
        per_device_train_batch_size=args.batch,
        gradient_accumulation_steps=1,
        max_completion_length=args.max_completion_length,
        max_prompt_length=args.prompt_length,
        beta=args.beta,
        sampling_logprobs=args.sampling_logprobs,
        learning_rate=1e-5,
        max_steps=args.warmup_steps + args.steps,
        logging_steps=1,
        save_steps=0,
        disable_tqdm=True,
        seed=args.seed,
    )


# ---------------------------------------------------------------- measurements


def run_training(cfg: RLOOConfig, args: argparse.Namespace):
    """Trains; returns (trainer, metrics of the measured steps, peak memory)."""
    from rloo_engine.trainer import RLOOTrainer

    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    rss = {"before_loading": _max_rss_mib()}
    trainer = RLOOTrainer(cfg)
    rss["models_loaded"] = _max_rss_mib()
    if trainer.acc.device.type != args.device:
        raise SystemExit(f"--device: {args.device}, but accelerate chose {trainer.acc.device}")
    raised = watch_peak_by_phase(trainer)
    trainer.train()
    rows = [json.loads(line) for line in (Path(cfg.output_dir) / "metrics.jsonl").read_text().splitlines()]
    measured = [r for r in rows if r["step"] > args.warmup_steps]
    if len(measured) != args.steps:
        raise SystemExit(f"metrics.jsonl: {len(measured)} measured steps; expected {args.steps}")
    memory = {"peak_rss_mib": _max_rss_mib(), "rss_high_water_mib": rss, "peak_raised_by_phase_mib": raised}
    if args.device == "cuda":
        memory["cuda_max_allocated_mib"] = torch.cuda.max_memory_allocated() / 2**20
    return trainer, measured, memory


def _max_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def watch_peak_by_phase(trainer) -> dict[str, float]:
    """Wraps the trainer's phase timer so that each phase adds how far it raised the process's RSS high-water
    mark (MiB, summed over steps): the phases that set the peak, as opposed to memory that was merely in use."""
    raised: dict[str, float] = defaultdict(float)
    timed = trainer._timed

    @contextmanager
    def timed_and_watched(name: str):
        before = _max_rss_mib()
        with timed(name):
            yield
        raised[name] += _max_rss_mib() - before

    trainer._timed = timed_and_watched
    return raised


def parameter_counts(model: torch.nn.Module) -> dict[str, int]:
    """body: the decoder's parameters (embedding lookup excluded, it does no FLOPs); head: the LM head matmul."""
    head = model.get_output_embeddings().weight.numel()
    embed = model.get_input_embeddings().weight.numel()
    total = sum(p.numel() for p in model.parameters())  # tied weights counted once
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    return {"total": total, "body": total - embed - (0 if tied else head), "head": head, "tied": tied}


def step_flops(row: dict, args: argparse.Namespace, n: dict[str, int], ref_forwards: int) -> dict[str, float]:
    """Model FLOPs of one optimizer step, from its logged token counts (formula in bench/README.md).

    A forward over t tokens of which c need logits costs 2*N_body*t + 2*N_head*c; a forward+backward
    costs 3x that. Attention-score FLOPs and padding are not counted (useful model FLOPs, as in MFU).
    """
    completion = row["completions/mean_length"] * args.batch
    prompt = row["num_tokens"] - completion
    full_forward = 2 * n["body"] * (prompt + completion) + 2 * n["head"] * completion
    return {
        # shared prefill: each prompt's tokens go through the model once, not G times
        "generation": 2 * n["body"] * (prompt / args.num_generations + completion) + 2 * n["head"] * completion,
        "reward": 0.0,
        "reference": ref_forwards * full_forward,
        "policy_update": 3 * full_forward,
    }


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def matmul_peak(device: str, dtype: torch.dtype, size: int, seconds: float) -> float:
    """Sustained FLOP/s of back-to-back `size` x `size` matmuls over about `seconds`."""
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    for _ in range(3):
        torch.matmul(a, b)
    _sync(device)
    calls, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        for _ in range(4 if device == "cpu" else 50):
            torch.matmul(a, b)
        calls += 4 if device == "cpu" else 50
        _sync(device)
    return 2 * size**3 * calls / (time.perf_counter() - start)


def generation_baseline(model, tokenizer, prompts: list[str], args: argparse.Namespace) -> dict[str, dict]:
    """Median time of `baseline_calls` generations per method, alternating, every completion exactly max length."""
    # min_new_tokens: no early EOS, so both methods produce the same number of tokens.
    params = SamplingParams(args.max_completion_length, max_prompt_length=args.baseline_prompt_length,
                            extra={"min_new_tokens": args.max_completion_length})
    backends = {"shared_prefill": HFGenerationBackend(lambda: model, tokenizer, params, shared_prefill=True),
                "num_return_sequences": HFGenerationBackend(lambda: model, tokenizer, params, shared_prefill=False)}
    wall: dict[str, list[float]] = {name: [] for name in backends}
    cpu: dict[str, list[float]] = {name: [] for name in backends}
    for call in range(args.baseline_calls + 1):  # call 0 warms up both
        for name, backend in backends.items():
            _sync(args.device)
            start, start_cpu = time.perf_counter(), time.process_time()
            rollout = backend.generate(prompts, args.num_generations)
            _sync(args.device)
            if call:
                wall[name].append(time.perf_counter() - start)
                cpu[name].append(time.process_time() - start_cpu)
    tokens = int(rollout.completion_mask.sum())
    return {name: {"seconds_per_call": statistics.median(wall[name]), "all_seconds": wall[name],
                   "cpu_seconds_per_call": statistics.median(cpu[name]), "completion_tokens_per_call": tokens,
                   "completion_tokens_per_s": tokens / statistics.median(wall[name])} for name in backends}


# ---------------------------------------------------------------- report


def reference_forwards(cfg: RLOOConfig) -> int:
    """No-grad forwards per generation batch in the reference phase (on-policy, as the bench runs): the
    reference model's if beta > 0, plus the policy's when its log-probs are not recorded while decoding."""
    if cfg.beta == 0:
        return 0
    return 1 if cfg.logprobs_from_generation else 2


def summarize(measured: list[dict], args: argparse.Namespace, n: dict[str, int], ref_forwards: int) -> dict:
    steps = len(measured)
    step_time = sum(r["step_time"] for r in measured) / steps
    phases = {}
    for name in PHASES:
        seconds = sum(r[f"timing/{name}_s"] for r in measured) / steps
        flops = sum(step_flops(r, args, n, ref_forwards)[name] for r in measured) / steps
        phases[name] = {"seconds": seconds, "share": seconds / step_time, "flops": flops,
                        "flop_per_s": flops / seconds if seconds else 0.0}
    other = step_time - sum(p["seconds"] for p in phases.values())
    phases["other"] = {"seconds": other, "share": other / step_time, "flops": 0.0, "flop_per_s": 0.0}
    completion = sum(r["completions/mean_length"] for r in measured) * args.batch / steps
    all_tokens = sum(r["num_tokens"] for r in measured) / steps
    total_flops = sum(p["flops"] for p in phases.values())
    return {
        "step_time_s": step_time,
        "phases": phases,
        "completion_tokens_per_step": completion,
        "tokens_per_step": all_tokens,
        "completion_tokens_per_s_generation": completion / phases["generation"]["seconds"],
        "completion_tokens_per_s_end_to_end": completion / step_time,
        "tokens_per_s_end_to_end": all_tokens / step_time,
        "flops_per_step": total_flops,
        "achieved_flop_per_s": total_flops / step_time,
    }


def print_report(r: dict) -> None:
    a, n, s, peak = r["args"], r["params"], r["summary"], r["peak_flop_per_s"]
    G = a["num_generations"]
    print(f"RLOO engine throughput (bench/engine_throughput.py, {r['date']})")
    print(f"model     qwen2, hidden {a['hidden']}, {a['layers']} layers, vocab {r['vocab_size']}: "
          f"{n['total'] / 1e6:.2f}M params (body {n['body'] / 1e6:.2f}M, LM head {n['head'] / 1e6:.2f}M"
          f"{', tied' if n['tied'] else ''})")
    print(f"run       {a['device']} {a['dtype']} ({r['threads']} torch threads); {a['batch']} completions/step = "
          f"{a['batch'] // G} prompts x G={G}; prompt {a['prompt_length']} tok, "
          f"<= {a['max_completion_length']} new tok; beta {a['beta']}, sampling_logprobs {a['sampling_logprobs']}")
    load = r["load_average_1min"]
    # "after" includes this run's own threads; a full core's worth of other work means contention.
    busy = load["before"] >= 1 or load["after"] >= r["threads"] + 1
    print(f"steps     {a['steps']} measured after {a['warmup_steps']} warmup; 1-min load average "
          f"{load['before']:.1f} before, {load['after']:.1f} after, on {r['cpu_count']} CPUs"
          f"{'  << other work was running: times inflated, see bench/README.md' if busy else ''}\n")
    print(f"{'phase':<16}{'s/step':>9}{'share':>8}{'GFLOP/step':>12}{'GFLOP/s':>10}{'of peak':>9}")
    for name, p in s["phases"].items():
        frac = f"{p['flop_per_s'] / peak:8.1%}" if p["flops"] else f"{'-':>8}"
        flops = f"{p['flops'] / 1e9:12.2f}" if p["flops"] else f"{'-':>12}"
        rate = f"{p['flop_per_s'] / 1e9:10.2f}" if p["flops"] else f"{'-':>10}"
        print(f"{name:<16}{p['seconds']:9.3f}{p['share']:8.1%}{flops}{rate} {frac}")
    print(f"{'step':<16}{s['step_time_s']:9.3f}{1:8.1%}{s['flops_per_step'] / 1e9:12.2f}"
          f"{s['achieved_flop_per_s'] / 1e9:10.2f} {s['achieved_flop_per_s'] / peak:8.1%}\n")
    print(f"tokens/s  {s['completion_tokens_per_s_generation']:.0f} completion tok/s while generating; "
          f"{s['completion_tokens_per_s_end_to_end']:.0f} completion tok/s end to end; "
          f"{s['tokens_per_s_end_to_end']:.0f} tok/s end to end (prompt + completion, "
          f"{s['tokens_per_step']:.0f} tok/step)")
    mem = r["memory"]
    cuda = ""
    if "cuda_max_allocated_mib" in mem:
        cuda = f"; torch.cuda.max_memory_allocated {mem['cuda_max_allocated_mib']:.0f} MiB"
    print(f"memory    peak RSS {mem['peak_rss_mib']:.0f} MiB (whole process, incl. Python and torch){cuda}")
    if "rss_high_water_mib" in mem:
        hw, raised = mem["rss_high_water_mib"], mem["peak_raised_by_phase_mib"]
        phases = ", ".join(f"{name} +{raised.get(name, 0.0):.0f}" for name in PHASES)
        print(f"          high-water: {hw['before_loading']:.0f} MiB before the trainer (Python, torch, tokenizer "
              f"training), {hw['models_loaded']:.0f} with models loaded; raised by {phases} MiB")
    print(f"peak      {a['dtype']} matmul {a['peak_size']}x{a['peak_size']}: {peak / 1e9:.2f} GFLOP/s "
          f"(sustained over {a['peak_seconds']:g} s in this run)")
    print(f"achieved  {s['achieved_flop_per_s'] / 1e9:.2f} GFLOP/s = {s['achieved_flop_per_s'] / peak:.1%} of peak "
          f"(model FLOPs / step time)")
    print("formula   forward over t tokens, c of them predicted: 2*N_body*t + 2*N_head*c; forward+backward: 3x;")
    ref = {0: "none (beta 0)", 1: "1 forward (reference; the policy's log-probs come from decoding)",
           2: "2 forwards (policy + reference log-probs)"}[r["reference_forwards"]]
    print(f"          generation = 1 forward (prompt once per group of G); reference = {ref};")
    print("          policy_update = 1 forward+backward; attention scores and padding not counted\n")
    b = r["baseline"]
    shared, repeated = b["shared_prefill"], b["num_return_sequences"]
    print(f"baseline  generation only, same run: {a['batch'] // G} prompts x G={G}, "
          f"prompt {a['baseline_prompt_length']} tok, {a['max_completion_length']} new tok, "
          f"median of {a['baseline_calls']} calls")
    for label, m in (("shared prefill (default)", shared), ("num_return_sequences (G prefills)", repeated)):
        print(f"  {label:<36}{m['seconds_per_call']:7.3f} s/call {m['completion_tokens_per_s']:7.0f} tok/s "
              f"{m['cpu_seconds_per_call']:7.3f} process-CPU s/call")
    print(f"  speedup of shared prefill: {repeated['seconds_per_call'] / shared['seconds_per_call']:.2f}x wall time, "
          f"{repeated['cpu_seconds_per_call'] / shared['cpu_seconds_per_call']:.2f}x process CPU time")


def quiet_libraries() -> None:
    """No progress bars or warnings from transformers/datasets: the report is the only output."""
    import datasets
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    warnings.filterwarnings("ignore")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cpu":
        os.environ["ACCELERATE_USE_CPU"] = "true"  # keep accelerate off a GPU that happens to be present
    quiet_libraries()
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="rloo-bench-") as tmp:
        root = Path(tmp)
        tokenizer, model_dir, prompt_file, baseline_prompts = build_assets(root, args)
        cfg = bench_config(args, model_dir, prompt_file, root / "run")
        trainer, measured, memory = run_training(cfg, args)
        model = trainer.acc.unwrap_model(trainer.policy)
        params = parameter_counts(model)
        peak = matmul_peak(args.device, DTYPES[args.dtype], args.peak_size, args.peak_seconds)
        baseline = generation_baseline(model, trainer.tokenizer, baseline_prompts, args)
    ref_forwards = reference_forwards(cfg)
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "load_average_1min": {"before": load_before, "after": os.getloadavg()[0]},
        "vocab_size": len(tokenizer),
        "params": params,
        "reference_forwards": ref_forwards,
        "summary": summarize(measured, args, params, ref_forwards),
        "memory": memory,
        "peak_flop_per_s": peak,
        "baseline": baseline,
        "measured_steps": measured,
    }
    print_report(result)
    if args.output:
        args.output.write_text(json.dumps(result, indent=2) + "\n")
        print(f"\nwrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
