"""The visual demo (issue 49): a tiny LLaVA learns with RLOO to name the colour of the square in a picture.

    python -m rloo_engine.demo.visual_demo --out .rloo-demo/visual      # about a minute on 2 CPU cores

1. A random-init LLaVA (CLIP vision tower, projector, Llama decoder; `testing.tiny_vlm`) over a tokenizer trained
   on the task's text is fine-tuned on replies that name the right colour only half the time
   (`visual_task.sft_completion`): the SFT policy looks at the picture a little and guesses a lot.
2. RLOO (`RLOOTrainer`, TRL's API) trains it on held-out pictures against the hidden rule, a reward function that
   reads each row's picture (`visual_task.gold_reward`).
3. The SFT and trained policies answer the same eval pictures, sampled at the training temperature, and the rule
   judges both: the gold score, the share of replies naming the right colour, and the win rate of the trained
   policy over SFT (a tie counts half).

`--smoke` runs the same code path sized for CI (seconds). docs/demo.md has the measured numbers.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from rloo_engine.demo import visual_task as task
from rloo_engine.demo.sft import IGNORE_INDEX, fit, shuffled_batches


@dataclass(frozen=True)
class VisualSettings:
    hidden: int = 64  # the decoder; the vision tower is CLIP-shaped, 32 wide, one layer
    layers: int = 2
    sft_examples: int = 2_000
    sft_steps: int = 300
    sft_batch_size: int = 32
    sft_learning_rate: float = 3e-3
    train_prompts: int = 512
    eval_prompts: int = 128
    # RLOOConfig options of the RLOO run (docs/configuration.md)
    rloo: dict = field(default_factory=lambda: {
        "num_generations": 8, "per_device_train_batch_size": 32, "max_completion_length": 8,
        "max_prompt_length": 64, "temperature": 1.0, "learning_rate": 1e-3, "lr_scheduler_type": "constant",
        "beta": 0.05, "max_steps": 200, "logging_steps": 20, "save_steps": 0, "disable_dropout": True, "seed": 0,
        "report_to": [],
    })


DEMO = VisualSettings()
SMOKE = VisualSettings(hidden=32, sft_examples=64, sft_steps=4, sft_batch_size=8, train_prompts=16, eval_prompts=8,
                       rloo={**DEMO.rloo, "num_generations": 4, "per_device_train_batch_size": 8, "max_steps": 2,
                             "logging_steps": 1})


def build_sft(out: Path, s: VisualSettings, seed: int, progress: bool = True) -> Path:
    """The SFT policy: a random-init tiny LLaVA fine-tuned on half-right replies (teacher forcing, loss on the
    reply and its EOS only), saved with its processor to `out`."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from rloo_engine.data import render_prompt
    from rloo_engine.testing.tiny_vlm import build_vlm
    from rloo_engine.vision import with_image_items

    base = build_vlm(out.with_name(out.name + "-init"), "llava", hidden=s.hidden, layers=s.layers, seed=seed,
                     texts=task.corpus())
    processor = AutoProcessor.from_pretrained(base)
    model = AutoModelForImageTextToText.from_pretrained(base)
    rng = random.Random(seed)
    examples = []
    for row in task.rows(s.sft_examples, seed=seed + 1):
        prompt = render_prompt(processor, with_image_items(row["prompt"], 1))
        examples.append((prompt, task.sft_completion(row["colour"], rng), row["image"]))
    torch.manual_seed(seed)
    fit(model, shuffled_batches(examples, s.sft_batch_size, rng), lambda batch: _reply_loss(model, processor, batch),
        s.sft_steps, s.sft_learning_rate, "visual demo: SFT policy", progress)
    model.save_pretrained(out)
    processor.save_pretrained(out)
    return out


def _reply_loss(model, processor, batch: list[tuple[str, str, object]]) -> torch.Tensor:
    """Mean next-token cross-entropy over the replies' tokens and EOS; the prompt (image tokens included) is -100."""
    tok = processor.tokenizer
    rows, pixels = [], []
    for prompt, reply, image in batch:
        enc = processor(text=[prompt], images=[[image]], return_tensors="pt", add_special_tokens=False)
        reply_ids = tok(reply, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        prompt_ids = enc["input_ids"][0].tolist()
        rows.append((prompt_ids + reply_ids, [IGNORE_INDEX] * len(prompt_ids) + reply_ids))
        pixels.append(enc["pixel_values"])
    width = max(len(ids) for ids, _ in rows)
    input_ids = torch.tensor([ids + [tok.pad_token_id] * (width - len(ids)) for ids, _ in rows])
    labels = torch.tensor([lab + [IGNORE_INDEX] * (width - len(lab)) for _, lab in rows])
    mask = torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids, _ in rows])
    logits = model(input_ids=input_ids, attention_mask=mask, pixel_values=torch.cat(pixels)).logits
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(),
                                             ignore_index=IGNORE_INDEX)


@torch.no_grad()
def sample_replies(model_dir: Path, rows: list[dict], max_new_tokens: int, seed: int) -> list[str]:
    """One reply per row, sampled at temperature 1 (the distribution RLOO optimises), as the engine generates."""
    from transformers import AutoModelForImageTextToText, AutoProcessor, set_seed

    from rloo_engine.data import render_prompt
    from rloo_engine.vision import encode_prompts, numbers_own_positions, placeholder_token_ids, with_image_items

    processor = AutoProcessor.from_pretrained(model_dir)
    model = AutoModelForImageTextToText.from_pretrained(model_dir).eval()
    texts = [render_prompt(processor, with_image_items(r["prompt"], 1)) for r in rows]
    ids, mask, vision = encode_prompts(processor, texts, [[r["image"]] for r in rows], None,
                                       numbers_own_positions(model))
    set_seed(seed)
    out = model.generate(input_ids=ids, attention_mask=mask, **vision.model_kwargs(ids.size(1)), do_sample=True,
                         temperature=1.0, top_k=0, max_new_tokens=max_new_tokens,
                         pad_token_id=processor.tokenizer.pad_token_id,
                         suppress_tokens=placeholder_token_ids(model.config))
    return processor.tokenizer.batch_decode(out[:, ids.size(1):], skip_special_tokens=True)


def judge(rows: list[dict], replies: list[str]) -> dict[str, float]:
    scores = [task.gold_score(reply, r["colour"]) for r, reply in zip(rows, replies)]
    right = [set(task.named_colours(reply)) == {r["colour"]} for r, reply in zip(rows, replies)]
    return {"gold_score": sum(scores) / len(scores), "right_colour": sum(right) / len(right)}


def run(out: Path, s: VisualSettings = DEMO, seed: int = 0, progress: bool = True) -> dict:
    """SFT, RLOO, then both policies judged by the hidden rule on the same eval pictures; the summary is also
    written to `out/summary.json`."""
    import datasets

    from rloo_engine import RLOOConfig, RLOOTrainer

    sft = build_sft(out / "sft", s, seed, progress)
    train_rows = task.rows(s.train_prompts, seed=seed + 2)
    dataset = datasets.Dataset.from_list([{"prompt": r["prompt"], "image": r["image"]} for r in train_rows])
    args = RLOOConfig(output_dir=str(out / "rloo"), disable_tqdm=not progress, **s.rloo)
    RLOOTrainer(model=str(sft), reward_funcs=task.gold_reward, args=args, train_dataset=dataset).train()
    eval_rows = task.rows(s.eval_prompts, seed=seed + 3)
    new_tokens = s.rloo["max_completion_length"]
    sft_replies = sample_replies(sft, eval_rows, new_tokens, seed)
    policy_replies = sample_replies(out / "rloo" / "final", eval_rows, new_tokens, seed)
    wins = [(task.gold_score(p, r["colour"]) > task.gold_score(q, r["colour"]))
            + 0.5 * (task.gold_score(p, r["colour"]) == task.gold_score(q, r["colour"]))
            for r, p, q in zip(eval_rows, policy_replies, sft_replies)]
    summary = {"sft": judge(eval_rows, sft_replies), "policy": judge(eval_rows, policy_replies),
               "win_rate_vs_sft": sum(wins) / len(wins), "eval_prompts": len(eval_rows),
               "examples": [{"colour": r["colour"], "sft": q, "policy": p}
                            for r, p, q in list(zip(eval_rows, policy_replies, sft_replies))[:4]],
               "settings": asdict(s), "seed": seed}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rloo_engine.demo.visual_demo", description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=".rloo-demo/visual", help="where the models and summary.json go")
    parser.add_argument("--smoke", action="store_true", help="the CI-sized run: the same code path, seconds")
    parser.add_argument("--seed", type=int, default=0)
    a = parser.parse_args(argv)
    summary = run(Path(a.out), SMOKE if a.smoke else DEMO, a.seed)
    print(json.dumps({k: summary[k] for k in ("sft", "policy", "win_rate_vs_sft", "examples")}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
