"""Soft verdicts from the judge's log-probabilities (`judge.verdict: logprobs`), as AlpacaEval 2's weighted annotator.

The template asks for one letter and the request sets `logprobs: true, top_logprobs: k`, so the chat completion
carries `choices[0].logprobs.content[i].top_logprobs[j].{token, logprob}`: the k likeliest tokens at each position
of the reply. Only the first position is read (AlpacaEval reads `content[0]` with `max_tokens: 1`). Its
alternatives that are the letter `A` or `B` (surrounding whitespace ignored: tokenizers spell " A" and "A"
apart) give

    P(slot A) = P(A) / (P(A) + P(B)),

the variants of one letter summed. A letter outside the top k counts as probability 0, as in AlpacaEval, where
a missing token's log-probability is -inf; when neither letter is there the reply has no soft verdict. The hard
verdict is the argmax: `A` above 0.5, `B` below, `tie` at exactly 0.5.
"""

from __future__ import annotations

import math
from typing import Any

from rloo_engine.evaluation.parsing import SlotVerdict

LETTERS = ("A", "B")


def first_token_alternatives(body: Any) -> list[dict[str, Any]] | None:
    """The `top_logprobs` of the reply's first token, or None when the chat completion carries no log-probabilities."""
    try:
        positions = body["choices"][0]["logprobs"]["content"]
        alternatives = positions[0]["top_logprobs"]
    except (TypeError, KeyError, IndexError):
        return None
    if not isinstance(alternatives, list) or not alternatives:
        return None
    return [a for a in alternatives if isinstance(a, dict)]


def letter_logprobs(alternatives: list[dict[str, Any]]) -> dict[str, list[float]]:
    """{letter: log-probabilities of the alternatives spelling it}; a letter absent from them is absent."""
    found: dict[str, list[float]] = {}
    for alternative in alternatives:
        token, logprob = alternative.get("token"), alternative.get("logprob")
        if not isinstance(token, str) or token.strip() not in LETTERS:
            continue
        if isinstance(logprob, bool) or not isinstance(logprob, int | float) or math.isnan(logprob):
            continue
        found.setdefault(token.strip(), []).append(min(float(logprob), 0.0))
    return found


def slot_a_probability(alternatives: list[dict[str, Any]]) -> float | None:
    """P(A) / (P(A) + P(B)) over the first token's alternatives; None when neither letter is among them."""
    found = letter_logprobs(alternatives)
    top = max((lp for lps in found.values() for lp in lps), default=-math.inf)
    if top == -math.inf:
        return None
    # Shifted by the largest log-probability, so two unlikely letters do not underflow to 0 / 0.
    p_a, p_b = (sum(math.exp(lp - top) for lp in found.get(letter, [])) for letter in LETTERS)
    return p_a / (p_a + p_b)


def hard_verdict(p_slot_a: float) -> SlotVerdict:
    """The argmax of a soft verdict; exactly 0.5 is a tie."""
    return "A" if p_slot_a > 0.5 else "B" if p_slot_a < 0.5 else "tie"


def shown_alternatives(alternatives: list[dict[str, Any]], limit: int = 5) -> str:
    """The first `limit` alternatives as `'token' (p=0.42)`, for an error message."""
    shown = []
    for alternative in alternatives[:limit]:
        logprob = alternative.get("logprob")
        p = f"{math.exp(min(float(logprob), 0.0)):.2f}" if isinstance(logprob, int | float) else "?"
        shown.append(f"{alternative.get('token')!r} (p={p})")
    return ", ".join(shown) or "none"
