"""Pairings: which answers are compared, in which slot orders, and how slot verdicts become a prompt's score.

Position-bias control:
- `both` order mode judges every pair as (a, b) and (b, a). Rule `agree`: a win counts only when
  both orders pick the same model; disagreement is a tie. Rule `average`: each order counts as
  half a judgment (the prompt's score is the mean of its two orders).
- `single` judges one order per prompt, chosen by a coin flip seeded with (seed, prompt id).
- Identical answers are a tie without a call.
A prompt with any failed order is a failure (`api_error` over `parse_error`), never a guess.

Soft verdicts (`judge.verdict: logprobs`): an order's score for model_a is the judge's probability for
model_a's slot, P(A) / (P(A) + P(B)) with model_a in slot A and 1 minus it in slot B, and a prompt's
score is the mean of its orders (`average`; config.py refuses `agree`: a probability does not agree or
disagree). W/L/T and consistency still count the hard verdicts, each order's argmax.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Literal

from rloo_engine.config_base import ConfigError
from rloo_engine.evaluation.config import PAIRINGS
from rloo_engine.evaluation.judges.base import Judgment, SlotPair, Status

Order = Literal["ab", "ba"]
Winner = Literal["a", "b", "tie"]
SCORE: dict[str, float] = {"a": 1.0, "b": 0.0, "tie": 0.5}


@dataclass(frozen=True)
class PairItem:
    """One prompt of one pairing: model_a's and model_b's completions, and the orders to judge."""

    pairing: str
    prompt_id: str
    prompt: str
    completion_a: str
    completion_b: str
    orders: tuple[Order, ...]  # () when the completions are identical
    reference: str | None = None  # the gold answer a reference-guided template shows; None without one
    images: tuple[str, ...] = ()  # the prompt's image references: in the cache key, not shown to the judge

    def slot_pair(self, order: Order) -> SlotPair:
        if order == "ab":
            return SlotPair(self.prompt, self.completion_a, self.completion_b, self.reference, self.images)
        return SlotPair(self.prompt, self.completion_b, self.completion_a, self.reference, self.images)


@dataclass
class ItemOutcome:
    """A prompt's result for model_a: `score` in [0, 1], and the units counted as wins/losses/ties."""

    status: Status
    score: float | None = None
    units: list[float] = field(default_factory=list)
    consistent: bool | None = None  # both orders picked the same winner (None: not judged in both orders)
    identical: bool = False


def orders_for(prompt_id: str, order_mode: str, seed: int) -> tuple[Order, ...]:
    if order_mode == "both":
        return ("ab", "ba")
    coin = hashlib.sha256(f"{seed}:{prompt_id}".encode()).digest()[0] & 1
    return ("ab",) if coin == 0 else ("ba",)


def winner(order: Order, verdict: str | None) -> Winner | None:
    """Which model a slot verdict picks, given which model sat in slot A."""
    if verdict == "tie":
        return "tie"
    if verdict not in ("A", "B"):
        return None
    first = "a" if order == "ab" else "b"
    return first if verdict == "A" else ("b" if first == "a" else "a")


def order_score(order: Order, judgment: Judgment) -> float:
    """model_a's score from one order's judgment: the soft preference for its slot when the judge gave one,
    else 1 for a win, 0.5 for a tie, 0 for a loss."""
    if judgment.slot_a_probability is not None:
        return judgment.slot_a_probability if order == "ab" else 1.0 - judgment.slot_a_probability
    return SCORE[winner(order, judgment.verdict)]


def combine_orders(item: PairItem, judgments: dict[Order, Judgment], rule: str) -> ItemOutcome:
    """The prompt's outcome from its per-order judgments (see the module docstring for the rules)."""
    if not item.orders:
        return ItemOutcome("ok", 0.5, [0.5], identical=True)
    statuses = [judgments[o].status for o in item.orders]
    if "api_error" in statuses:
        return ItemOutcome("api_error")
    if "parse_error" in statuses:
        return ItemOutcome("parse_error")
    winners = [winner(o, judgments[o].verdict) for o in item.orders]
    scores = [order_score(o, judgments[o]) for o in item.orders]
    if len(winners) == 1:
        return ItemOutcome("ok", scores[0], [SCORE[winners[0]]])
    consistent = winners[0] == winners[1]
    if rule == "average":
        return ItemOutcome("ok", sum(scores) / 2, [SCORE[w] for w in winners], consistent)
    score = SCORE[winners[0]] if consistent else 0.5
    return ItemOutcome("ok", score, [score], consistent)


def choose_pairings(requested: list[str] | None, available: set[str]) -> list[str]:
    """The pairings to run: those requested (each must have both sides), or every one whose sides exist."""
    sources = {
        "policy": "policy_model_path, policy_completions or --policy",
        "sft": "sft_model_path, sft_completions or --sft",
        "reference": "reference_column or reference_completions",
    }
    if requested is None:
        names = [n for n, sides in PAIRINGS.items() if set(sides) <= available]
        if not names:
            raise ConfigError(
                f"pairings: no pairing has both of its sides (available: {sorted(available) or 'none'}); give at "
                f"least two of policy ({sources['policy']}), sft ({sources['sft']}), reference ({sources['reference']})"
            )
        return names
    for name in requested:
        for side in PAIRINGS[name]:
            if side not in available:
                raise ConfigError(f"pairings: {name} needs {side} completions; set {sources[side]}")
    return list(requested)


def build_items(
    pairing: str,
    side_a: dict[str, str],
    side_b: dict[str, str],
    prompts: list[tuple[str, str]],
    order_mode: str,
    seed: int,
    reference_answers: dict[str, str] | None = None,
    images: dict[str, tuple[str, ...]] | None = None,
) -> tuple[list[PairItem], int]:
    """(items, n_missing) for `prompts` as (prompt_id, prompt text); prompts lacking either completion are counted.
    `reference_answers` ({prompt_id: gold answer}) go with the items for a reference-guided template, `images`
    ({prompt_id: image references}) for the cache key."""
    items, missing = [], 0
    for pid, text in prompts:
        a, b = side_a.get(pid), side_b.get(pid)
        if a is None or b is None:
            missing += 1
            continue
        orders = () if a == b else orders_for(pid, order_mode, seed)
        reference = reference_answers.get(pid) if reference_answers is not None else None
        pictures = images.get(pid, ()) if images is not None else ()
        items.append(PairItem(pairing, pid, text, a, b, orders, reference, pictures))
    return items, missing
