"""The demo's reward model: a sequence classifier fitted to gold-labelled preference pairs with the Bradley-Terry loss.

    loss = -log sigmoid(r(prompt, chosen) - r(prompt, rejected))

r is read at the last real token of prompt + completion (right padding, found from the attention
mask), exactly where `rloo_engine.reward_sources.RewardModelSource` reads it during RLOO. The backbone
starts from the SFT policy's weights, as in InstructGPT: it already reads the task's language, so
a minute of training is enough to learn the preference.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification, PreTrainedTokenizerBase

from rloo_engine.demo import toy_task
from rloo_engine.demo.sft import fit, shuffled_batches


@dataclass(frozen=True)
class PreferencePair:
    prompt: str
    chosen: str
    rejected: str


def preference_pairs(
    rng: random.Random,
    topic_pairs: list[tuple[str, str]],
    n: int,
    edit_fraction: float = 0.5,
    min_margin: float = toy_task.TIE_MARGIN,
) -> list[PreferencePair]:
    """`n` pairs of completions for the same prompt, ordered by the gold rule; gold ties are skipped.

    A share `edit_fraction` of the pairs is a completion and a one-edit variant of it
    (`toy_task.edited_completion`); the rest are two independent `toy_task.varied_completion` samples.
    """
    pairs: list[PreferencePair] = []
    while len(pairs) < n:
        prompt = toy_task.sample_prompt(rng, topic_pairs)
        a = toy_task.varied_completion(rng, prompt)
        if rng.random() < edit_fraction:
            b = toy_task.edited_completion(rng, prompt, a)
        else:
            b = toy_task.varied_completion(rng, prompt)
        ga, gb = toy_task.gold_score(prompt, a), toy_task.gold_score(prompt, b)
        if abs(ga - gb) < min_margin:
            continue
        pairs.append(PreferencePair(prompt, a, b) if ga > gb else PreferencePair(prompt, b, a))
    return pairs


def reward_model_from_policy(policy_dir: str | Path) -> torch.nn.Module:
    """A num_labels=1 classifier whose backbone is a copy of the causal LM in `policy_dir` (fresh score head)."""
    config = AutoConfig.from_pretrained(policy_dir)
    config.num_labels = 1
    model = AutoModelForSequenceClassification.from_config(config)
    policy = AutoModelForCausalLM.from_pretrained(policy_dir)
    model.model.load_state_dict(policy.model.state_dict())
    return model


def score_texts(model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, texts: list[str]) -> torch.Tensor:
    """Rewards (B,) of `texts`, read at each row's last real token (right padding)."""
    tokenizer.padding_side = "right"
    enc = tokenizer(texts, padding=True, return_tensors="pt")
    mask = enc["attention_mask"]  # (B, T)
    hidden = model.model(input_ids=enc["input_ids"], attention_mask=mask).last_hidden_state  # (B, T, H)
    last_real = mask.sum(-1) - 1  # (B,)
    return model.score(hidden[torch.arange(len(texts)), last_real]).squeeze(-1).float()


def bradley_terry_loss(chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """-log sigmoid(r_chosen - r_rejected), averaged over pairs; shapes (B,)."""
    return -torch.nn.functional.logsigmoid(chosen - rejected).mean()


@torch.no_grad()
def pairwise_accuracy(
    model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, pairs: list[PreferencePair], batch_size: int = 64
) -> float:
    """Fraction of `pairs` where the model scores the gold-chosen completion higher."""
    model.eval()
    correct = 0
    for start in range(0, len(pairs), batch_size):
        batch = pairs[start : start + batch_size]
        chosen = score_texts(model, tokenizer, [p.prompt + p.chosen for p in batch])
        rejected = score_texts(model, tokenizer, [p.prompt + p.rejected for p in batch])
        correct += int((chosen > rejected).sum())
    return correct / max(1, len(pairs))


@dataclass
class RewardModelResult:
    path: Path
    losses: list[float]  # per optimizer step
    heldout_accuracy: float


def train_reward_model(
    out_dir: str | Path,
    policy_dir: str | Path,
    tokenizer: PreTrainedTokenizerBase,
    train_pairs: list[PreferencePair],
    heldout_pairs: list[PreferencePair],
    steps: int = 300,
    batch_size: int = 32,
    learning_rate: float = 1e-3,
    seed: int = 0,
    progress: bool = True,
) -> RewardModelResult:
    """Fits a reward model on `train_pairs`, measures it on `heldout_pairs`, and saves it with `tokenizer`."""
    torch.manual_seed(seed)
    rng = random.Random(seed)
    model = reward_model_from_policy(policy_dir)
    model.config.pad_token_id = tokenizer.pad_token_id

    def pair_loss(batch: list[PreferencePair]) -> torch.Tensor:
        # Chosen and rejected in one forward: rows [0, B) chosen, [B, 2B) rejected.
        texts = [p.prompt + p.chosen for p in batch] + [p.prompt + p.rejected for p in batch]
        scores = score_texts(model, tokenizer, texts)
        return bradley_terry_loss(scores[: len(batch)], scores[len(batch):])

    losses = fit(model, shuffled_batches(train_pairs, batch_size, rng), pair_loss, steps, learning_rate,
                 "demo assets: reward model", progress)
    accuracy = pairwise_accuracy(model, tokenizer, heldout_pairs)
    out = Path(out_dir)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return RewardModelResult(out, losses, accuracy)
