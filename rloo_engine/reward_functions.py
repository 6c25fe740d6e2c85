"""Example reward functions, usable by import path (`rloo_engine.reward_functions:<name>`) and as templates.

A reward function receives keyword lists (`prompts`, `completions`, `completion_ids`, plus every
extra dataset column) and returns one float per completion, or None where it cannot judge. With
conversational prompts each completion is TRL's `[{"role": "assistant", "content": ...}]`.
"""

from __future__ import annotations

import os

from rloo_engine.data import completion_text

TARGET_WORD = os.environ.get("RLOO_TARGET_WORD", "the")


def target_word_fraction(completions: list, **_) -> list[float]:
    """Fraction of whitespace-separated words equal to TARGET_WORD (env `RLOO_TARGET_WORD`, default "the")."""
    scores = []
    for text in map(completion_text, completions):
        words = text.split()
        scores.append(sum(w == TARGET_WORD for w in words) / len(words) if words else 0.0)
    return scores


def brevity(completion_ids: list[list[int]], **_) -> list[float]:
    """1 / (1 + number of completion tokens): prefers short answers."""
    return [1.0 / (1 + len(ids)) for ids in completion_ids]


def char_fraction(completions: list, **_) -> list[float]:
    """Fraction of characters equal to TARGET_CHAR (env `RLOO_TARGET_CHAR`, default "e"): a dense toy reward."""
    target = os.environ.get("RLOO_TARGET_CHAR", "e")
    return [text.count(target) / len(text) if text else 0.0 for text in map(completion_text, completions)]


def even_token_fraction(completion_ids: list[list[int]], **_) -> list[float]:
    """Fraction of completion tokens with an even id: depends on every sampled token, so even a random-init model's
    completions get different rewards (bench/gpu_check.sh uses it to make every step's gradient non-zero)."""
    return [sum(t % 2 == 0 for t in ids) / len(ids) if ids else 0.0 for ids in completion_ids]
