"""Win-rate statistics: exact values for known counts, bootstrap coverage, length control, paired tests."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy.stats import binomtest

from rloo_engine.evaluation import EvalConfig, run_evaluation, stats
from tests.evaluation.eval_helpers import write_jsonl


def _scores(n_win: int, n_loss: int, n_tie: int) -> np.ndarray:
    return np.array([1.0] * n_win + [0.0] * n_loss + [0.5] * n_tie)


def test_known_counts_give_the_exact_win_rate_and_standard_error():
    wins, losses, ties = 6, 3, 1
    n = wins + losses + ties
    p = (wins + 0.5 * ties) / n
    variance = (wins * (1 - p) ** 2 + losses * p**2 + ties * (0.5 - p) ** 2) / (n - 1)
    assert stats.win_rate(wins, losses, ties) == p == 0.65
    assert stats.standard_error(_scores(wins, losses, ties)) == pytest.approx(math.sqrt(variance / n), rel=1e-12)
    assert stats.win_rate(0, 0, 0) is None
    assert stats.standard_error(np.array([1.0])) is None


def _marker_run(tmp_path, wins: int, losses: int, ties: int, **overrides):
    """An evaluation whose python judge produces exactly W wins, L losses and T ties for the policy."""
    prompts, policy = [], []
    for i in range(wins + losses + ties):
        prompt = f"prompt {i}"
        kind = "win" if i < wins else "loss" if i < wins + losses else "tie"
        reference = {"win": f"plain reference {i}", "loss": f"[win] reference {i}", "tie": f"[tie] reference {i}"}[kind]
        prompts.append({"prompt": prompt, "reference": reference})
        policy.append(
            {"prompt": prompt, "completion": {"win": f"[win] {i}", "loss": f"p{i}", "tie": f"[tie] {i}"}[kind]}
        )
    cfg = EvalConfig.model_validate(
        {
            "prompts": str(write_jsonl(tmp_path / "prompts.jsonl", prompts)),
            "reference_column": "reference",
            "policy_completions": str(write_jsonl(tmp_path / "policy.jsonl", policy)),
            "judge": {"backend": "python", "function": "tests.evaluation.eval_helpers:marker_rule"},
            "output_dir": str(tmp_path / "out"),
            "progress": False,
            "bootstrap_resamples": 1000,
            **overrides,
        }
    )
    return run_evaluation(cfg).pairings["policy_vs_reference"]


def test_an_evaluation_with_known_counts_reports_the_exact_rate_and_se(tmp_path):
    r = _marker_run(tmp_path, 6, 3, 1)
    assert (r.n_win, r.n_loss, r.n_tie, r.n_valid) == (6, 3, 1, 10)
    assert r.win_rate == 0.65
    assert r.se == pytest.approx(stats.standard_error(_scores(6, 3, 1)), rel=1e-12)
    assert r.ci_low < 0.65 < r.ci_high
    assert r.consistency_rate == 1.0


def test_bootstrap_ci_covers_the_true_rate_at_about_its_nominal_level():
    rng = np.random.default_rng(123)
    p_win, p_loss, p_tie = 0.45, 0.35, 0.20
    true_rate = p_win + 0.5 * p_tie
    simulations, n = 200, 100
    covered = 0
    for sim in range(simulations):
        scores = rng.choice([1.0, 0.0, 0.5], size=n, p=[p_win, p_loss, p_tie])
        low, high = stats.bootstrap_mean_ci(scores, resamples=1000, confidence=0.95, seed=sim)
        covered += low <= true_rate <= high
    # 200 simulations: the coverage estimate has sd ~0.015 around ~0.95 (percentile bootstraps run slightly low)
    assert 0.90 <= covered / simulations <= 0.99


def test_bootstrap_is_seeded_and_resamples_prompts():
    scores = np.random.default_rng(0).random(50)  # continuous, so different resamples give different quantiles
    assert stats.bootstrap_mean_ci(scores, 1000, 0.95, seed=7) == stats.bootstrap_mean_ci(scores, 1000, 0.95, seed=7)
    assert stats.bootstrap_mean_ci(scores, 1000, 0.95, seed=7) != stats.bootstrap_mean_ci(scores, 1000, 0.95, seed=8)
    chunks = list(stats.bootstrap_index_chunks(n=50, resamples=1000, seed=0))
    assert sum(len(c) for c in chunks) == 1000 and all(c.shape[1] == 50 for c in chunks)


def test_lc_win_rate_equals_the_raw_rate_when_lengths_are_equal():
    rng = np.random.default_rng(0)
    scores = rng.choice([0.0, 0.5, 1.0], size=200)
    lengths = rng.integers(5, 80, size=200)
    assert stats.length_controlled_win_rate(scores, lengths, lengths) == pytest.approx(scores.mean(), abs=1e-12)
    low, high = stats.bootstrap_lc_ci(scores, lengths, lengths, 1000, 0.95, seed=0)
    assert (low, high) == pytest.approx(stats.bootstrap_mean_ci(scores, 1000, 0.95, seed=0), abs=1e-9)


def test_lc_win_rate_removes_a_pure_length_preference():
    # The first model is longer on 70% of prompts and the judge simply prefers longer answers.
    rng = np.random.default_rng(1)
    n = 400
    delta = np.where(rng.random(n) < 0.7, 1, -1) * rng.integers(1, 40, size=n)
    len_b = rng.integers(20, 60, size=n)
    len_a = len_b + delta
    p_win = 1 / (1 + np.exp(-3 * np.tanh(delta / np.std(delta))))
    scores = (rng.random(n) < p_win).astype(float)
    raw = scores.mean()
    lc = stats.length_controlled_win_rate(scores, len_a, len_b)
    assert raw > 0.6
    assert abs(lc - 0.5) < 0.06 < abs(raw - 0.5)


def test_an_evaluation_warns_when_lc_and_raw_rates_differ(tmp_path):
    prompts = [{"prompt": f"p{i}", "reference": "r" * 10} for i in range(40)]
    policy = [{"prompt": f"p{i}", "completion": "x" * (20 + i % 7 if i % 5 else 3 + i % 4)} for i in range(40)]
    cfg = EvalConfig.model_validate(
        {
            "prompts": str(write_jsonl(tmp_path / "prompts.jsonl", prompts)),
            "reference_column": "reference",
            "policy_completions": str(write_jsonl(tmp_path / "policy.jsonl", policy)),
            "judge": {"backend": "python", "function": "tests.evaluation.eval_helpers:prefer_longer"},
            "output_dir": str(tmp_path / "out"),
            "progress": False,
            "length_unit": "chars",
        }
    )
    report = run_evaluation(cfg)
    r = report.pairings["policy_vs_reference"]
    assert r.win_rate == 0.8
    assert r.lc_win_rate < r.win_rate - 0.05
    assert any("length-controlled" in w and "policy_vs_reference" in w for w in report.warnings)


def test_sign_test_is_the_exact_binomial_test_on_discordant_prompts():
    first = np.array([1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0.5, 1], dtype=float)
    second = np.array([0, 0, 0, 0, 0, 0, 0, 0.5, 1, 1, 0.5, 1], dtype=float)
    result = stats.sign_test(first, second)
    assert (result.n_first_better, result.n_second_better, result.n_same) == (8, 2, 2)
    assert result.p_value == pytest.approx(binomtest(8, 10, 0.5).pvalue) == pytest.approx(0.109375)
    assert stats.sign_test(first, first).p_value == 1.0


def test_paired_difference_of_policy_and_sft_against_the_same_references(tmp_path):
    prompts = [{"prompt": f"p{i}", "reference": "r" * 10} for i in range(30)]
    # policy beats the reference on 24 prompts, SFT on 12 (prefer_longer), always on the same prompts first
    policy = [{"prompt": f"p{i}", "completion": "x" * (20 if i < 24 else 5)} for i in range(30)]
    sft = [{"prompt": f"p{i}", "completion": "y" * (20 if i < 12 else 5)} for i in range(30)]
    cfg = EvalConfig.model_validate(
        {
            "prompts": str(write_jsonl(tmp_path / "prompts.jsonl", prompts)),
            "reference_column": "reference",
            "policy_completions": str(write_jsonl(tmp_path / "policy.jsonl", policy)),
            "sft_completions": str(write_jsonl(tmp_path / "sft.jsonl", sft)),
            "judge": {"backend": "python", "function": "tests.evaluation.eval_helpers:prefer_longer"},
            "output_dir": str(tmp_path / "out"),
            "progress": False,
        }
    )
    d = run_evaluation(cfg).paired_difference
    assert d.n == 30
    assert d.difference == pytest.approx(0.8 - 0.4)
    assert (d.n_first_better, d.n_second_better, d.n_same) == (12, 0, 18)
    assert d.p_value == pytest.approx(binomtest(12, 12, 0.5).pvalue)
    assert d.ci_low > 0
