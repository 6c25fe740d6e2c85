"""Position bias and length control: numbers that would mislead are corrected, refused, and warned about."""

from __future__ import annotations

import numpy as np
import pytest

from rloo_engine.evaluation import EvalConfig, run_evaluation, stats
from rloo_engine.evaluation.judges.base import Judgment
from rloo_engine.evaluation.pairings import PairItem, combine_orders
from rloo_engine.evaluation.report import format_summary
from rloo_engine.evaluation.result_checks import pairing_warnings
from rloo_engine.evaluation.scoring import JudgedItem, summarize_pairing
from tests.evaluation.eval_helpers import write_jsonl

TRUTH, SLOT_BIAS, N_PROMPTS, SEEDS = 0.65, 0.5, 200, 50


def _cfg(tmp_path, **overrides) -> EvalConfig:
    values = {
        "prompts": str(tmp_path / "prompts.jsonl"),
        "judge": {"backend": "python", "function": "tests.evaluation.eval_helpers:prefer_longer"},
        "bootstrap_resamples": 1000,
        "output_dir": str(tmp_path / "out"),
        "progress": False,
    }
    values.update(overrides)
    return EvalConfig.model_validate(values)


def _simulated_pairing(seed: int, cfg: EvalConfig):
    """A judge that picks slot A with probability SLOT_BIAS whatever the content, and otherwise the
    content winner; model_a's content wins on TRUTH of the prompts. Verdicts are drawn vectorised."""
    rng = np.random.default_rng(seed)
    content_a = rng.random(N_PROMPTS) < TRUTH  # model_a's answer is the better one
    by_slot = rng.random((N_PROMPTS, 2)) < SLOT_BIAS  # orders ab, ba
    # order ab: slot A holds model_a's answer; order ba: slot A holds model_b's
    verdict_ab = np.where(by_slot[:, 0] | content_a, "A", "B")
    verdict_ba = np.where(by_slot[:, 1] | ~content_a, "A", "B")
    judged = []
    for i in range(N_PROMPTS):
        item = PairItem("policy_vs_reference", f"p{i}", f"prompt {i}", f"answer a {i}", f"answer b {i}", ("ab", "ba"))
        judgments = {"ab": Judgment("ok", str(verdict_ab[i])), "ba": Judgment("ok", str(verdict_ba[i]))}
        judged.append(JudgedItem(item, judgments, combine_orders(item, judgments, cfg.both_orders_rule)))
    return summarize_pairing("policy_vs_reference", "policy", "reference", judged, 0, cfg)


def test_bias_corrected_rate_recovers_the_truth_of_a_slot_biased_judge_and_the_warning_fires(tmp_path):
    cfg = _cfg(tmp_path)
    covered_raw = covered_corrected = 0
    for seed in range(SEEDS):
        r = _simulated_pairing(seed, cfg)
        covered_raw += r.ci_low <= TRUTH <= r.ci_high
        covered_corrected += r.bias_corrected_ci_low <= TRUTH <= r.bias_corrected_ci_high
        assert r.slot_bias == pytest.approx(SLOT_BIAS, abs=0.15)
        warnings = pairing_warnings(r, cfg)
        assert any("position bias" in w and "bias-corrected" in w for w in warnings), (seed, warnings)
    assert covered_corrected / SEEDS >= 0.9
    # the raw rate (expected 0.575) is what misled users; its exact interval is conservative with ties (agree rule)
    assert covered_raw / SEEDS <= 0.5


def test_bias_correction_changes_nothing_for_an_unbiased_judge():
    scores = np.array([1.0, 1.0, 0.0, 0.5])
    first_slot = np.array([1, 1, 1, 1])  # each prompt: one A, one B verdict
    decided = np.array([2, 2, 2, 2])
    assert stats.bias_corrected_rate(scores, first_slot, decided) == pytest.approx(scores.mean())
    assert stats.slot_bias(first_slot, decided) == 0.0


def test_a_run_with_a_slot_biased_judge_warns_in_the_report_and_the_cli_line(tmp_path):
    rng = np.random.default_rng(0)
    better = rng.random(N_PROMPTS) < TRUTH
    ids = range(N_PROMPTS)
    write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": f"post {i}"} for i in ids])
    policy = [{"prompt": f"post {i}", "completion": f"pol {i} [better]" if better[i] else f"pol {i}"} for i in ids]
    refs = [{"prompt": f"post {i}", "completion": f"ref {i}" if better[i] else f"ref {i} [better]"} for i in ids]
    cfg = _cfg(
        tmp_path,
        policy_completions=str(write_jsonl(tmp_path / "policy.jsonl", policy)),
        reference_completions=str(write_jsonl(tmp_path / "refs.jsonl", refs)),
        judge={"backend": "python", "function": "tests.evaluation.eval_helpers:slot_biased_rule"},
    )
    report = run_evaluation(cfg)
    r = report.pairings["policy_vs_reference"]
    assert r.win_rate < 0.6 and r.bias_corrected_ci_low <= better.mean() <= r.bias_corrected_ci_high
    assert any("position bias" in w for w in report.warnings)
    summary = format_summary(report)
    assert "bias-corrected" in summary and "warning: policy_vs_reference: position bias" in summary


def test_agree_and_average_give_the_same_rate_for_a_judge_that_answers_only_a_or_b(tmp_path):
    agree = _simulated_pairing(3, _cfg(tmp_path, both_orders_rule="agree"))
    average = _simulated_pairing(3, _cfg(tmp_path, both_orders_rule="average"))
    assert agree.win_rate == pytest.approx(average.win_rate)
    assert (agree.ci_low, agree.ci_high) == pytest.approx((average.ci_low, average.ci_high))


# ---------------------------------------------------------------- length control outside the data
def test_lc_is_not_estimable_when_one_model_is_always_longer():
    rng = np.random.default_rng(0)
    len_b = rng.integers(5, 20, size=200)
    len_a = len_b + rng.integers(3, 40, size=200)  # always longer
    reason = stats.lc_support_problem(len_a, len_b, min_share=0.05, unit="words")
    assert reason is not None and "longer on 200 of 200" in reason and "extrapolation" in reason
    overlapping = len_b + rng.integers(-10, 40, size=200)
    assert stats.lc_support_problem(overlapping, len_b, min_share=0.05, unit="words") is None
    assert stats.lc_support_problem(len_b, len_b, min_share=0.05, unit="words") is None  # equal lengths: LC = raw


def test_a_length_separated_evaluation_reports_lc_as_not_estimable_and_says_why(tmp_path):
    # The policy is always longer; a judge with a 55% preference for it regardless of length.
    n = 120
    write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": f"post {i}", "reference": "short ref"} for i in range(n)])
    policy = [
        {"prompt": f"post {i}", "completion": ("[win] " if i % 20 < 11 else "") + "a much longer answer " * (1 + i % 5)}
        for i in range(n)
    ]
    cfg = _cfg(
        tmp_path,
        reference_column="reference",
        policy_completions=str(write_jsonl(tmp_path / "policy.jsonl", policy)),
        judge={"backend": "python", "function": "tests.evaluation.eval_helpers:marker_rule_no_length"},
    )
    report = run_evaluation(cfg)
    r = report.pairings["policy_vs_reference"]
    assert r.win_rate == pytest.approx(0.55)
    assert r.lc_win_rate is None and r.lc_ci_low is None and r.lc_ci_high is None
    assert "longer on 120 of 120 prompts" in r.lc_not_estimable
    warning = next(w for w in report.warnings if "length-controlled" in w)
    assert "not estimable" in warning and "outside the data" in warning
    assert "rewarding length" not in warning  # it is not the judge's fault
    summary = format_summary(report)
    assert "LC    n/e  " in summary and "n/e%" not in summary and "n/a%" not in summary
