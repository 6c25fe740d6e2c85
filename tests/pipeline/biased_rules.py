"""A position-biased judge rule for the pipeline tests: "A" nine times in ten, whatever the answers."""

from __future__ import annotations

import hashlib

from tests.pipeline.judge_rules import prefer_more_e


def mostly_first_slot(prompt: str, answer_a: str, answer_b: str) -> str:
    u = hashlib.sha256(f"{prompt}\x00{answer_a}\x00{answer_b}".encode()).digest()[0] / 256
    return "A" if u < 0.9 else prefer_more_e(prompt, answer_a, answer_b)
