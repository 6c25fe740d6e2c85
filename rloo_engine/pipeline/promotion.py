"""The promotion gate: a trained policy becomes a registry candidate only when the lower bound of its
policy-vs-SFT win-rate CI reaches `tracking.promotion.min_ci_low` on at least `min_n` valid prompts. The rate is
the length-controlled one by default (`promotion.rate`): longer answers are the classic way an RL policy games
its judge, and a raw rate passes them. The reason says why, either way."""

from __future__ import annotations

from typing import Any

from rloo_engine.pipeline.config import PromotionGate
from rloo_engine.pipeline.stage_results import EvalSummary, GateDecision

GATE_PAIRING = "policy_vs_sft"
# promotion.rate -> (the PairingResult field prefix, how the reason names it)
GATED_RATES = {
    "length_controlled": ("lc_", "length-controlled win rate"),
    "style_controlled": ("sc_", "style-controlled win rate"),
    "raw": ("", "raw win rate"),
}


def promotion_decision(evaluation: EvalSummary, gate: PromotionGate) -> GateDecision:
    """Passes when the gated rate's CI lower bound >= gate.min_ci_low; the reason says why either way."""
    result = evaluation.pairings.get(GATE_PAIRING)
    threshold = gate.min_ci_low

    def refuse(reason: str, ci_low: float | None = None) -> GateDecision:
        return GateDecision(passed=False, ci_low=ci_low, threshold=threshold, reason=reason, rate=gate.rate)

    if result is None:
        return refuse(f"{GATE_PAIRING} was not evaluated (see evaluation.pairings); the promotion gate needs it")
    n_valid = result.get("n_valid")
    if n_valid is None or n_valid < gate.min_n:
        return refuse(f"{GATE_PAIRING} has {n_valid} valid prompts, fewer than promotion.min_n {gate.min_n}; "
                      "evaluate on more prompts (evaluation.num_samples) or lower min_n", result.get("ci_low"))
    prefix, label, note = _gated_rate(result, gate)
    if prefix is None:
        return refuse(note)
    rate, ci_low, ci_high = (result.get(f"{prefix}{k}") for k in ("win_rate", "ci_low", "ci_high"))
    if ci_low is None:
        return refuse(f"{GATE_PAIRING} {label} has no confidence interval ({n_valid} valid judgments of "
                      f"{result.get('n')})")
    detail = f"{label} {rate:.3f}, CI [{ci_low:.3f}, {ci_high:.3f}], n={result.get('n')}{_raw_detail(result, prefix)}"
    passed = ci_low >= threshold
    reason = (f"{GATE_PAIRING} {label} CI lower bound {ci_low:.3f} {'>=' if passed else '<'} min_ci_low "
              f"{threshold:.3f} ({detail}){note}")
    return GateDecision(passed=passed, ci_low=ci_low, threshold=threshold, reason=reason, rate=gate.rate)


def _gated_rate(result: dict[str, Any], gate: PromotionGate) -> tuple[str | None, str, str]:
    """(field prefix, label, note): the configured rate, or the raw one when it is not estimable and
    `allow_unadjusted` says so; prefix None (and the refusal as the note) when it is not estimable."""
    prefix, label = GATED_RATES[gate.rate]
    problem = result.get(f"{prefix}not_estimable") if prefix else None
    if problem is None:
        return prefix, label, ""
    if gate.allow_unadjusted:
        return "", "raw win rate", (f"; the {label} is not estimable ({problem}), so promotion.allow_unadjusted "
                                    "gated on the raw rate, which rewards whatever the judge rewards, length included")
    return None, label, (
        f"{GATE_PAIRING} {label} is not estimable: {problem}. A raw win rate "
        f"{_fmt(result.get('win_rate'))} can come from length or style alone, the classic way an RL policy games "
        "its judge; evaluate on prompts where the two models' lengths overlap, or set "
        "tracking.promotion.allow_unadjusted: true to gate on the raw rate"
    )


def _raw_detail(result: dict[str, Any], prefix: str) -> str:
    if not prefix:
        return ""
    return f"; raw win rate {_fmt(result.get('win_rate'))} [{_fmt(result.get('ci_low'))}, {_fmt(result.get('ci_high'))}]"


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"
