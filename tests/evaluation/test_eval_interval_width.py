"""Issue 41, item 5: the win-rate interval with ties covers at its level without costing twice the judge budget.

Clopper-Pearson on per-prompt scores with ties covered 0.996 at 1.3-1.5x the bootstrap's width (about twice
the prompts for the same precision). Simulations are seeded and vectorised where they can be."""

from __future__ import annotations

import numpy as np
import pytest

from rloo_engine.evaluation import stats


def _sets(n: int, p: float, tie: float, sims: int) -> np.ndarray:
    """`sims` sets of n per-prompt scores (1, 0.5 or 0) with mean p and a tie on `tie` of the prompts."""
    rng = np.random.default_rng(n * 1009 + int(p * 100) * 7 + int(tie * 10))
    return rng.choice([1.0, 0.0, 0.5], size=(sims, n), p=[p - tie / 2, 1 - p - tie / 2, tie])


@pytest.mark.parametrize(("n", "p", "tie"), [(50, 0.5, 0.4), (50, 0.7, 0.3), (200, 0.5, 0.4), (200, 0.7, 0.3),
                                             (200, 0.85, 0.2), (200, 0.3, 0.4)])
def test_with_ties_the_interval_covers_and_is_within_a_tenth_of_the_bootstraps_width(n, p, tie):
    sets = _sets(n, p, tie, sims=1000)
    intervals = np.array([stats.win_rate_ci(s, 0.95) for s in sets])
    coverage = np.mean((intervals[:, 0] <= p) & (p <= intervals[:, 1]))
    width = np.mean(intervals[:, 1] - intervals[:, 0])
    boot = np.array([stats.bootstrap_mean_ci(s, 1000, 0.95, seed=0) for s in sets[:200]])
    boot_width = np.mean(boot[:, 1] - boot[:, 0])
    assert coverage >= 0.94
    assert width <= 1.1 * boot_width, (width, boot_width)


@pytest.mark.parametrize("n", [50, 100, 400])
@pytest.mark.parametrize(("p", "tie"), [(0.5, 0.0), (0.5, 0.6), (0.9, 0.1), (0.95, 0.1), (0.97, 0.0), (0.6, 0.8)])
def test_the_interval_covers_across_tie_rates_and_near_the_boundary(n, p, tie):
    sets = _sets(n, p, tie, sims=2000)
    intervals = np.array([stats.win_rate_ci(s, 0.95) for s in sets])
    assert np.mean((intervals[:, 0] <= p) & (p <= intervals[:, 1])) >= 0.94


def test_small_sets_keep_the_exact_interval_and_zero_one_sets_keep_clopper_pearson():
    assert stats.win_rate_ci(np.ones(3), 0.95) == pytest.approx((0.292, 1.0), abs=1e-3)  # 3 of 3
    ties = np.array([1.0, 0.5, 0.5, 0.0, 1.0, 0.5] * 5)  # 30 prompts: exact, whatever the variance
    low, high = stats.win_rate_ci(ties, 0.95)
    assert (low, high) == pytest.approx(stats._beta_interval(ties.sum(), 30.0, 0.05))
    binary = np.array([1.0] * 70 + [0.0] * 30)  # 0/1 scores: n_eff = n - 1, Clopper-Pearson's width
    cp = stats._beta_interval(70.0, 100.0, 0.05)
    assert stats.win_rate_ci(binary, 0.95) == pytest.approx(cp, abs=0.005)


def test_a_set_of_all_ties_keeps_a_width_and_all_wins_the_exact_bound():
    low, high = stats.win_rate_ci(np.full(100, 0.5), 0.95)
    assert low < 0.5 < high and high - low > 0.05
    assert stats.win_rate_ci(np.ones(100), 0.95)[0] == pytest.approx(0.025 ** (1 / 100), abs=1e-9)


def test_a_controlled_rate_of_all_wins_keeps_the_exact_interval_not_a_zero_width_bootstrap():
    scores, len_a, len_b = np.ones(60), np.arange(60) + 5.0, np.full(60, 30.0)
    assert stats.bootstrap_lc_ci(scores, len_a, len_b, 1000, 0.95, seed=0) == stats.win_rate_ci(scores, 0.95)
