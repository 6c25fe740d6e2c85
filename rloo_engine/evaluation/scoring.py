"""From judged prompts to reported numbers: one PairingResult per pairing, and the policy-minus-SFT difference."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from rloo_engine.evaluation import stats
from rloo_engine.evaluation.config import EvalConfig
from rloo_engine.evaluation.judges.base import Judgment
from rloo_engine.evaluation.pairings import ItemOutcome, Order, PairItem
from rloo_engine.evaluation.report import PairedDifference, PairingResult


@dataclass
class JudgedItem:
    item: PairItem
    judgments: dict[Order, Judgment]
    outcome: ItemOutcome


def text_length(text: str, unit: str) -> int:
    return len(text.split()) if unit == "words" else len(text)


_MARKDOWN = (re.compile(r"^#{1,6}\s", re.M), re.compile(r"^\s*(?:[-*+]|\d+[.)])\s", re.M),
             re.compile(r"\*\*[^*\n]+\*\*|__[^_\n]+__"))


def markdown_counts(text: str) -> tuple[int, int, int]:
    """Headers, list items and bold spans (stats.STYLE_ELEMENTS): what Arena-Hard's style control counts."""
    return tuple(len(pattern.findall(text)) for pattern in _MARKDOWN)


def slot_verdict_counts(valid: Sequence[JudgedItem]) -> tuple[np.ndarray, np.ndarray]:
    """Per prompt: its verdicts for slot A (a tie counts half), and all its verdicts (A, B or tie)."""
    first_slot = np.array([sum(_slot_a_share(jd.verdict) for jd in j.judgments.values()) for j in valid], dtype=float)
    verdicts = np.array([sum(jd.verdict in ("A", "B", "tie") for jd in j.judgments.values()) for j in valid],
                        dtype=float)
    return first_slot, verdicts


def _slot_a_share(verdict: str | None) -> float:
    return 1.0 if verdict == "A" else 0.5 if verdict == "tie" else 0.0


def _rate(numerator: int, denominator: int) -> float | None:
    return None if denominator == 0 else numerator / denominator


def summarize_pairing(
    name: str, model_a: str, model_b: str, judged: Sequence[JudgedItem], n_missing: int, cfg: EvalConfig
) -> PairingResult:
    valid = [j for j in judged if j.outcome.status == "ok"]
    units = np.array([u for j in valid for u in j.outcome.units])
    n_win, n_loss, n_tie = int((units == 1.0).sum()), int((units == 0.0).sum()), int((units == 0.5).sum())
    scores = np.array([j.outcome.score for j in valid], dtype=float)
    len_a = np.array([text_length(j.item.completion_a, cfg.length_unit) for j in valid], dtype=float)
    len_b = np.array([text_length(j.item.completion_b, cfg.length_unit) for j in valid], dtype=float)

    resamples, level, seed = cfg.bootstrap_resamples, cfg.confidence_level, cfg.seed
    ci = stats.win_rate_ci(scores, level)
    lc_problem = stats.lc_support_problem(
        len_a, len_b, cfg.lc_min_overlap, cfg.length_unit, first=model_a
    ) or stats.lc_fit_problem(
        scores, len_a, len_b
    )
    lc, lc_ci = None, None
    if lc_problem is None:
        lc = stats.length_controlled_win_rate(scores, len_a, len_b)
        lc_ci = stats.bootstrap_lc_ci(scores, len_a, len_b, resamples, level, seed)

    sc = _style_controlled(scores, len_a, len_b, valid, lc_problem, lc, lc_ci, cfg, model_a)
    first_slot, verdicts = slot_verdict_counts(valid)
    corrected_ci = stats.bias_corrected_ci(scores, first_slot, verdicts, level)
    bias_ci = stats.slot_bias_interval(first_slot, verdicts, level) if verdicts.sum() else None
    both_judged = [j for j in valid if j.outcome.consistent is not None]
    all_len_a = [text_length(j.item.completion_a, cfg.length_unit) for j in judged]
    all_len_b = [text_length(j.item.completion_b, cfg.length_unit) for j in judged]
    return PairingResult(
        name=name,
        model_a=model_a,
        model_b=model_b,
        n=len(judged),
        n_valid=len(valid),
        n_win=n_win,
        n_loss=n_loss,
        n_tie=n_tie,
        n_parse_error=sum(j.outcome.status == "parse_error" for j in judged),
        n_api_error=sum(j.outcome.status == "api_error" for j in judged),
        n_identical=sum(j.outcome.identical for j in judged),
        n_missing=n_missing,
        win_rate=float(scores.mean()) if len(scores) else None,  # the unit is the prompt, as for the CI
        se=stats.standard_error(scores),
        ci_low=ci[0] if ci else None,
        ci_high=ci[1] if ci else None,
        lc_win_rate=lc,
        lc_ci_low=lc_ci[0] if lc_ci else None,
        lc_ci_high=lc_ci[1] if lc_ci else None,
        lc_not_estimable=lc_problem,
        **sc,
        consistency_rate=_rate(sum(bool(j.outcome.consistent) for j in both_judged), len(both_judged)),
        first_slot_rate=float(stats.first_slot_rate(first_slot, verdicts)) if verdicts.sum() else None,
        n_slot_verdicts=int(verdicts.sum()),
        slot_bias=float(stats.slot_bias(first_slot, verdicts)) if verdicts.sum() else None,
        slot_bias_ci_low=bias_ci[0] if bias_ci else None,
        slot_bias_ci_high=bias_ci[1] if bias_ci else None,
        bias_corrected_win_rate=stats.bias_corrected_rate(scores, first_slot, verdicts),
        bias_corrected_ci_low=corrected_ci[0] if corrected_ci else None,
        bias_corrected_ci_high=corrected_ci[1] if corrected_ci else None,
        rate_by_length_difference=stats.length_strata(scores, len_a, len_b, level),
        mean_length_a=float(np.mean(all_len_a)) if all_len_a else None,
        mean_length_b=float(np.mean(all_len_b)) if all_len_b else None,
        length_unit=cfg.length_unit,
    )


def _style_controlled(scores: np.ndarray, len_a: np.ndarray, len_b: np.ndarray, valid: Sequence[JudgedItem],
                      lc_problem: str | None, lc: float | None, lc_ci: tuple[float, float] | None, cfg: EvalConfig,
                      model_a: str) -> dict:
    """The `sc_*` fields: the rate at equal length and equal markdown. Where no answer has markdown it is LC."""
    if len(scores) == 0:
        return {"sc_features": [], "sc_win_rate": None, "sc_ci_low": None, "sc_ci_high": None,
                "sc_not_estimable": lc_problem}
    counts_a = np.array([markdown_counts(j.item.completion_a) for j in valid], dtype=float).reshape(-1, 3)
    counts_b = np.array([markdown_counts(j.item.completion_b) for j in valid], dtype=float).reshape(-1, 3)
    features, names = stats.style_features(len_a, len_b, counts_a, counts_b)
    result = {"sc_features": names, "sc_win_rate": None, "sc_ci_low": None, "sc_ci_high": None,
              "sc_not_estimable": lc_problem}
    if names == ["length"]:
        return {**result, "sc_win_rate": lc, "sc_ci_low": lc_ci[0] if lc_ci else None,
                "sc_ci_high": lc_ci[1] if lc_ci else None}
    problem = lc_problem or stats.style_support_problem(features, names, cfg.lc_min_overlap, first=model_a) \
        or stats.controlled_fit_problem(scores, features)
    if problem is not None:
        return {**result, "sc_not_estimable": problem}
    ci = stats.bootstrap_controlled_ci(scores, features, cfg.bootstrap_resamples, cfg.confidence_level, cfg.seed)
    return {**result, "sc_win_rate": stats.controlled_win_rate(scores, features), "sc_ci_low": ci[0],
            "sc_ci_high": ci[1]}


def paired_difference(first: Sequence[JudgedItem], second: Sequence[JudgedItem], cfg: EvalConfig) -> PairedDifference:
    """Per-prompt score of `first` minus `second` (e.g. policy vs references minus SFT vs the same references)."""
    second_scores = {j.item.prompt_id: j.outcome.score for j in second if j.outcome.status == "ok"}
    common = [
        (j.outcome.score, second_scores[j.item.prompt_id])
        for j in first
        if j.outcome.status == "ok" and j.item.prompt_id in second_scores
    ]
    a = np.array([c[0] for c in common], dtype=float)
    b = np.array([c[1] for c in common], dtype=float)
    diff = a - b
    ci = stats.bootstrap_mean_ci(diff, cfg.bootstrap_resamples, cfg.confidence_level, cfg.seed)
    test = stats.sign_test(a, b)
    return PairedDifference(
        first=first[0].item.pairing if first else "policy_vs_reference",
        second=second[0].item.pairing if second else "sft_vs_reference",
        n=len(common),
        difference=float(diff.mean()) if len(common) else None,
        se=stats.standard_error(diff),
        ci_low=ci[0] if ci else None,
        ci_high=ci[1] if ci else None,
        n_first_better=test.n_first_better,
        n_second_better=test.n_second_better,
        n_same=test.n_same,
        p_value=test.p_value,
    )
