"""Supervised fine-tuning of the demo's small Qwen2-shaped policy: teacher forcing, loss on completion tokens only.

The loop is the whole algorithm: batch -> forward -> masked next-token loss -> backward -> clip ->
AdamW step -> log. Prompts are masked out of the loss (label -100), and every completion ends with
EOS, so the model learns when to stop as well as what to say.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PreTrainedTokenizerBase, Qwen2Config

from rloo_engine.progress import progress_bar

IGNORE_INDEX = -100  # label of positions without a loss (prompt and padding)


def policy_config(tokenizer: PreTrainedTokenizerBase, hidden: int, layers: int, heads: int = 4) -> Qwen2Config:
    """A small Qwen2 decoder over `tokenizer`'s vocabulary (hidden 128, 2 layers, 512 tokens: about 0.46M parameters)."""
    return Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=hidden * 3,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads // 2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.eos_token_id,
    )


def tokenize_example(tokenizer: PreTrainedTokenizerBase, prompt: str, completion: str) -> tuple[list[int], list[int]]:
    """(input_ids, labels) of prompt + completion + EOS; labels are IGNORE_INDEX on the prompt.

    Prompt and completion are tokenized separately, as the RLOO engine and the evaluation tokenize
    the prompt alone and sample the completion after it.
    """
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    completion_ids = tokenizer(completion, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return prompt_ids + completion_ids, [IGNORE_INDEX] * len(prompt_ids) + completion_ids


def collate(rows: list[tuple[list[int], list[int]]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pads (input_ids, labels) rows into tensors of shape (B, T) with an attention mask."""
    width = max(len(ids) for ids, _ in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (ids, lab) in enumerate(rows):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        labels[i, : len(lab)] = torch.tensor(lab)
        attention_mask[i, : len(ids)] = 1
    return {"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask}


def completion_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Mean next-token cross-entropy over completion tokens (position t predicts token t+1)."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits  # (B, T, V)
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].flatten(0, 1).float(), batch["labels"][:, 1:].flatten(), ignore_index=IGNORE_INDEX
    )


def warmup_cosine(step: int, total: int, warmup: int) -> float:
    """Learning-rate multiplier: linear warmup, then cosine decay to 10% of the peak."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


def shuffled_batches(items: list, batch_size: int, rng: random.Random) -> Iterator[list]:
    """Endless batches drawn without replacement, reshuffled whenever an epoch is used up."""
    order: list[int] = []
    while True:
        if len(order) < batch_size:
            order = list(range(len(items)))
            rng.shuffle(order)
        yield [items[order.pop()] for _ in range(batch_size)]


def fit(model: torch.nn.Module, batches: Iterator, loss_fn: Callable[[list], torch.Tensor], steps: int,
        learning_rate: float, desc: str, progress: bool) -> list[float]:
    """The builders' training loop: AdamW, warmup then cosine decay, gradient clipping, a progress bar."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, betas=(0.9, 0.98), weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: warmup_cosine(s, steps, max(1, steps // 20)))
    model.train()
    losses: list[float] = []
    bar = progress_bar(range(steps), desc=desc, unit="step", disable=not progress, dynamic_ncols=True)
    for _ in bar:
        loss = loss_fn(next(batches))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
    bar.close()
    return losses


@dataclass
class SFTResult:
    path: Path
    losses: list[float]  # per optimizer step
    num_parameters: int

    @property
    def first_loss(self) -> float:
        return _window_mean(self.losses[:10])

    @property
    def final_loss(self) -> float:
        return _window_mean(self.losses[-10:])


def train_sft(
    out_dir: str | Path,
    tokenizer: PreTrainedTokenizerBase,
    examples: list[tuple[str, str]],
    hidden: int = 128,
    layers: int = 2,
    steps: int = 600,
    batch_size: int = 32,
    learning_rate: float = 3e-3,
    seed: int = 0,
    progress: bool = True,
) -> SFTResult:
    """Trains a fresh policy on (prompt, completion) `examples` and saves it with `tokenizer` to `out_dir`."""
    torch.manual_seed(seed)
    rng = random.Random(seed)
    model = AutoModelForCausalLM.from_config(policy_config(tokenizer, hidden, layers))
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    rows = [tokenize_example(tokenizer, p, c) for p, c in examples]
    losses = fit(model, shuffled_batches(rows, batch_size, rng),
                 lambda rows_: completion_loss(model, collate(rows_, tokenizer.pad_token_id)),
                 steps, learning_rate, "demo assets: SFT policy", progress)
    out = Path(out_dir)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return SFTResult(out, losses, sum(p.numel() for p in model.parameters()))


def _window_mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")
