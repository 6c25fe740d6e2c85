"""What keeps a misleading number from being reported as a result: the failures that stop a run, and the
warnings printed next to the numbers (report, CLI line, MLflow tags, pipeline summary).

Stops (`EvaluationError`): a pairing with nothing to judge (every prompt id unmatched), a pairing
with no valid judgment, or more failed prompts than `max_failed_fraction` allows.
Missing completions count as failed. Warns: failed or missing prompts, a position-biased judge (a slot-bias
interval that excludes 0), judge noise (the orders disagree with no slot preferred), length control that is not
estimable, LC far from the raw rate, and a judge alias served by more than one model snapshot (cached verdicts
of one, new verdicts of another).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping

from rloo_engine.evaluation.config import EvalConfig
from rloo_engine.evaluation.errors import EvaluationError
from rloo_engine.evaluation.judges.base import Judgment
from rloo_engine.evaluation.report import PairingResult


class UntrustworthyResultError(EvaluationError):
    """The judging finished but its numbers would mislead; `report` holds them (not written as results.json)."""

    def __init__(self, message: str, report: object = None):
        super().__init__(message)
        self.report = report


def check_something_to_judge(name: str, n_items: int, n_missing: int, sources: str) -> None:
    """Fails before any call when no prompt of a pairing has completions from both sides."""
    if n_items == 0:
        raise EvaluationError(
            f"{name}: {n_missing} of {n_missing} eval prompts lack a completion from one side ({sources}); "
            "nothing to judge. Check that the completions files were made from this prompt set (ids are hashes "
            "of the prompt text)"
        )


def failure_problems(results: Mapping[str, PairingResult], cfg: EvalConfig) -> list[str]:
    """One message per pairing whose rate must not be reported. A prompt without a completion from one side is a
    failure like one without a verdict: a rate over the prompts that have both is not the rate of the set."""
    problems = []
    for r in results.values():
        failed = r.n_parse_error + r.n_api_error + r.n_missing
        total = r.n + r.n_missing
        counts = (f"{failed} of {total} prompts failed ({r.n_parse_error} parse_error, {r.n_api_error} api_error, "
                  f"{r.n_missing} missing a completion from {r.model_a} or {r.model_b})")
        if r.n_valid == 0:
            problems.append(f"{r.name}: no valid judgment: {counts}")
        elif failed > cfg.max_failed_fraction * total:
            problems.append(
                f"{r.name}: {counts}, more than max_failed_fraction {cfg.max_failed_fraction:g} allows; a rate over "
                f"the {r.n_valid} that survived is not the rate of the set"
            )
    return problems


def _slot_bias_text(r: PairingResult) -> str:
    return f"slot bias {r.slot_bias:.2f} [{r.slot_bias_ci_low:.2f}, {r.slot_bias_ci_high:.2f}]"


def _prefers_a_slot(r: PairingResult, cfg: EvalConfig) -> bool:
    """The slot-bias interval excludes 0 and the first-slot rate is further than the allowed deviation from 1/2.
    Low agreement between the orders alone is not position bias: a judge that judges each order on its own at
    near-chance confidence disagrees with itself as often, with no slot preferred."""
    if r.first_slot_rate is None or r.slot_bias_ci_low is None:
        return False
    return r.slot_bias_ci_low > 0.0 and abs(r.first_slot_rate - 0.5) > cfg.max_first_slot_deviation


def position_bias_warning(r: PairingResult, cfg: EvalConfig) -> str | None:
    if not _prefers_a_slot(r, cfg):
        return None
    first = round(r.first_slot_rate * r.n_slot_verdicts)
    reasons = [f"first-slot rate {r.first_slot_rate:.1%} ({first} of {r.n_slot_verdicts} verdicts) is more than "
               f"max_first_slot_deviation {cfg.max_first_slot_deviation:.0%} from 50%, {_slot_bias_text(r)}"]
    if r.consistency_rate is not None and r.consistency_rate < cfg.min_consistency:
        reasons.append(f"consistency {r.consistency_rate:.1%} < min_consistency {cfg.min_consistency:.0%}")
    corrected = ""
    if r.bias_corrected_win_rate is not None:
        ci = (
            f" [{r.bias_corrected_ci_low:.3f}, {r.bias_corrected_ci_high:.3f}]"
            if r.bias_corrected_ci_low is not None
            else ""
        )
        corrected = f"; bias-corrected win rate {r.bias_corrected_win_rate:.3f}{ci}"
    return (
        f"{r.name}: position bias: {', '.join(reasons)}; the judge answers by slot often enough to pull the raw win "
        f"rate {r.win_rate:.3f} toward 0.5{corrected}"
    )


def judge_noise_warning(r: PairingResult, cfg: EvalConfig) -> str | None:
    """Low agreement between a prompt's two orders from a judge with no slot preference."""
    if r.consistency_rate is None or r.consistency_rate >= cfg.min_consistency or _prefers_a_slot(r, cfg):
        return None
    bias = f" ({_slot_bias_text(r)})" if r.slot_bias_ci_low is not None else ""
    return (
        f"{r.name}: judge noise: the two orders of a prompt pick the same winner on only {r.consistency_rate:.1%} "
        f"(< min_consistency {cfg.min_consistency:.0%}), with no slot preferred{bias}; on many prompts the verdict "
        f"is close to a coin flip, so the win rate {r.win_rate:.3f} measures a hesitant judge and sits nearer 50% "
        "than a decisive judge's would. A stronger judge model, a clearer template or the logprobs verdict mode "
        "helps; the interval already includes this noise"
    )


def length_strata_text(r: PairingResult) -> str:
    """'; by length difference: +1 to +5 words 60% [..] n=33, ...': how the raw rate moves with length."""
    if not r.rate_by_length_difference:
        return ""
    parts = [
        f"{s['delta_min']:+g} to {s['delta_max']:+g} {r.length_unit} {100 * s['win_rate']:.0f}% "
        f"[{100 * s['ci_low']:.0f}%, {100 * s['ci_high']:.0f}%] n={s['n']}"
        for s in r.rate_by_length_difference
    ]
    return f"; raw rate by length difference ({r.model_a} minus {r.model_b}): " + ", ".join(parts)


def length_warning(r: PairingResult, cfg: EvalConfig) -> str | None:
    if r.lc_not_estimable:
        return (
            f"{r.name}: length-controlled win rate not estimable: {r.lc_not_estimable}; read the raw rate with the "
            f"mean lengths ({r.mean_length_a:.1f} vs {r.mean_length_b:.1f} {r.length_unit})"
            + length_strata_text(r)
        )
    if r.win_rate is None or r.lc_win_rate is None:
        return None
    gap = r.lc_win_rate - r.win_rate
    if abs(gap) <= cfg.lc_warning_threshold:
        return None
    return (
        f"{r.name}: length-controlled win rate {r.lc_win_rate:.3f} differs from the raw {r.win_rate:.3f} "
        f"by {gap:+.3f} (mean lengths {r.mean_length_a:.1f} vs {r.mean_length_b:.1f} {r.length_unit}); "
        "the judge may be rewarding length"
    )


def pairing_warnings(r: PairingResult, cfg: EvalConfig) -> list[str]:
    warnings = []
    failed = r.n_parse_error + r.n_api_error
    if failed:
        warnings.append(
            f"{r.name}: {failed} of {r.n} prompts have no verdict ({r.n_parse_error} parse_error, "
            f"{r.n_api_error} api_error); the win rate is over the {r.n_valid} valid ones"
        )
    if r.n_missing:
        warnings.append(f"{r.name}: {r.n_missing} prompts lack a completion from {r.model_a} or {r.model_b}")
    for warning in (position_bias_warning(r, cfg), judge_noise_warning(r, cfg), length_warning(r, cfg)):
        if warning:
            warnings.append(warning)
    return warnings


def report_warnings(results: Mapping[str, PairingResult], cfg: EvalConfig) -> list[str]:
    return [w for r in results.values() for w in pairing_warnings(r, cfg)]


def served_models(judgments: Iterable[tuple[Judgment, bool]]) -> dict[str, int]:
    """{model id the endpoint reported: judgments} over (judgment, cached) pairs; judgments without one left out."""
    return dict(Counter(j.served_model for j, _ in judgments if j.served_model))


def snapshot_warning(judgments: Iterable[tuple[Judgment, bool]], model: str | None) -> str | None:
    """Warns when the judgments of this run (cached or new) came from more than one served model.

    The cache key holds the alias (`gpt-4o`), not the snapshot behind it, which the provider moves: an old
    cache then mixes verdicts of two models into one rate without anything else showing it.
    """
    cached, new = Counter(), Counter()
    for j, was_cached in judgments:
        if j.served_model:
            (cached if was_cached else new)[j.served_model] += 1
    if len(cached.keys() | new.keys()) < 2:
        return None
    parts = []
    for name in sorted(cached.keys() | new.keys()):
        counts = [f"{n} {kind}" for n, kind in ((cached[name], "cached"), (new[name], "new")) if n]
        parts.append(f"{name} ({', '.join(counts)})")
    return (
        f"judge model {model!r} was served as {len(parts)} different snapshots: {', '.join(parts)}; the rates mix "
        "verdicts of different models. For one judge, use a fresh cache_path or pin judge.model to one snapshot"
    )


def judge_warnings(judgments: Iterable[tuple[Judgment, bool]], model: str | None) -> list[str]:
    warning = snapshot_warning(judgments, model)
    return [warning] if warning else []
