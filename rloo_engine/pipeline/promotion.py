"""The promotion gate: a trained policy becomes a registry candidate only when the lower bound of its
policy-vs-SFT win-rate CI reaches `tracking.promotion.min_ci_low` on at least `min_n` valid prompts; the reason
says why, either way."""

from __future__ import annotations

from rloo_engine.pipeline.config import PromotionGate
from rloo_engine.pipeline.stage_results import EvalSummary, GateDecision

GATE_PAIRING = "policy_vs_sft"


def promotion_decision(evaluation: EvalSummary, gate: PromotionGate) -> GateDecision:
    """Passes when policy_vs_sft's CI lower bound >= gate.min_ci_low; the reason says why either way."""
    result = evaluation.pairings.get(GATE_PAIRING)
    threshold = gate.min_ci_low
    if result is None:
        return GateDecision(
            passed=False,
            ci_low=None,
            threshold=threshold,
            reason=f"{GATE_PAIRING} was not evaluated (see evaluation.pairings); the promotion gate needs it",
        )
    ci_low, n_valid = result.get("ci_low"), result.get("n_valid")
    if ci_low is None:
        return GateDecision(
            passed=False,
            ci_low=None,
            threshold=threshold,
            reason=f"{GATE_PAIRING} has no confidence interval ({n_valid} valid judgments of {result.get('n')})",
        )
    if n_valid is None or n_valid < gate.min_n:
        return GateDecision(
            passed=False,
            ci_low=ci_low,
            threshold=threshold,
            reason=f"{GATE_PAIRING} has {n_valid} valid prompts, fewer than promotion.min_n {gate.min_n}; "
            "evaluate on more prompts (evaluation.num_samples) or lower min_n",
        )
    rate = result.get("win_rate")
    detail = f"win rate {rate:.3f}, CI [{ci_low:.3f}, {result.get('ci_high'):.3f}], n={result.get('n')}"
    if ci_low >= threshold:
        return GateDecision(
            passed=True,
            ci_low=ci_low,
            threshold=threshold,
            reason=f"{GATE_PAIRING} CI lower bound {ci_low:.3f} >= min_ci_low {threshold:.3f} ({detail})",
        )
    return GateDecision(
        passed=False,
        ci_low=ci_low,
        threshold=threshold,
        reason=f"{GATE_PAIRING} CI lower bound {ci_low:.3f} < min_ci_low {threshold:.3f} ({detail})",
    )
