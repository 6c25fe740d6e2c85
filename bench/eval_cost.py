"""What evaluation during training costs: one evaluation's `eval_runtime` against a training step's `step_time`,
measured in the same run, over the grid (model width x vocabulary 512 / 32k / 152k x prompt length 8 / 64 / 512).

Each cell trains `--steps` steps of `--batch` completions (G=4) with `eval_strategy: steps, eval_steps: 1` over
`--eval-prompts` prompts (G=4 each) and beta 0.05 (so the eval KL's two forwards are in), and prints the cost of
one evaluation in training steps and per completion. Run it alone on a pinned core:

    taskset -c 0 python bench/eval_cost.py
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
from pathlib import Path

import datasets

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.engine_throughput import _stdout_silenced, pseudo_words, sentences  # noqa: E402
from rloo_engine import RLOOConfig, RLOOTrainer  # noqa: E402
from rloo_engine.testing.tiny_models import build_causal_lm, train_tokenizer  # noqa: E402


def cell(root: Path, hidden: int, vocab: int, prompt_length: int, args) -> dict:
    rng = random.Random(0)
    words = pseudo_words(2000, rng)
    with _stdout_silenced():
        tokenizer = train_tokenizer(sentences(words, 5000, 12, rng), vocab_size=500)
    model = build_causal_lm(root / "policy", tokenizer, arch="qwen2", hidden=hidden, layers=2, seed=0,
                            vocab_size=vocab, max_position_embeddings=1024)
    texts = sentences(words, 64, prompt_length, rng)
    data = datasets.Dataset.from_list([{"prompt": t} for t in texts])
    cfg = RLOOConfig(output_dir=str(root / "out"), num_generations=4, per_device_train_batch_size=args.batch,
                     max_completion_length=args.completion, max_prompt_length=prompt_length, beta=0.05,
                     max_steps=args.steps, logging_steps=1, save_steps=0, disable_tqdm=True, seed=0,
                     eval_strategy="steps", eval_steps=1, per_device_eval_batch_size=args.batch, report_to="none")
    trainer = RLOOTrainer(model=str(model), reward_funcs="rloo_engine.reward_functions:char_fraction", args=cfg,
                          train_dataset=data, eval_dataset=data.select(range(args.eval_prompts)))
    trainer.train()
    rows = [json.loads(line) for line in (root / "out" / "metrics.jsonl").read_text().splitlines()][1:]  # warm-up
    step = statistics.mean(r["step_time"] for r in rows)
    evaluation = statistics.mean(r["eval_runtime"] for r in rows)
    eval_completions = args.eval_prompts * 4
    return {"hidden": hidden, "vocab": vocab, "prompt": prompt_length, "step_s": step, "eval_s": evaluation,
            "eval_in_steps": evaluation / step,
            "per_completion_ratio": (evaluation / eval_completions) / (step / args.batch)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, nargs="+", default=[64, 256])
    p.add_argument("--vocab", type=int, nargs="+", default=[512, 32768, 151936])
    p.add_argument("--prompt-length", type=int, nargs="+", default=[8, 64, 512])
    p.add_argument("--batch", type=int, default=16, help="completions per training step and per eval batch")
    p.add_argument("--eval-prompts", type=int, default=16)
    p.add_argument("--completion", type=int, default=32)
    p.add_argument("--steps", type=int, default=3, help="steps per cell; the first is left out")
    args = p.parse_args()
    results = []
    for hidden in args.hidden:
        for vocab in args.vocab:
            for length in args.prompt_length:
                with tempfile.TemporaryDirectory() as tmp:
                    results.append(cell(Path(tmp), hidden, vocab, length, args))
                r = results[-1]
                print(f"hidden {hidden:4d} vocab {vocab:6d} prompt {length:3d}: step {r['step_s']:.3f} s, eval "
                      f"{r['eval_s']:.3f} s = {r['eval_in_steps']:.2f} training steps; per completion "
                      f"{r['per_completion_ratio']:.2f}x a training step's", flush=True)
    worst = max(results, key=lambda r: r["per_completion_ratio"])
    print(f"worst cell: hidden {worst['hidden']} vocab {worst['vocab']} prompt {worst['prompt']}: an eval "
          f"completion costs {worst['per_completion_ratio']:.2f}x a training completion")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
