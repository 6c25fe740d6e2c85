"""Deterministic judges for the pipeline tests (the evaluation's `python` backend): no model, no network."""

from __future__ import annotations


def e_fraction(text: str) -> float:
    return text.count("e") / len(text) if text else 0.0


def prefer_more_e(prompt: str, answer_a: str, answer_b: str) -> str:
    """Prefers the answer with the larger fraction of "e" characters: the training reward, as a judge."""
    a, b = e_fraction(answer_a), e_fraction(answer_b)
    if abs(a - b) < 1e-9:
        return "tie"
    return "A" if a > b else "B"
