"""Win-rate statistics as pure numpy functions: rate, standard error, bootstrap CIs, length control, paired tests.

The unit of every statistic is the prompt. `scores` holds one number per prompt in [0, 1]: the
first model's result against the second (1 win, 0 loss, 0.5 tie; both-order averaging gives
quarters). Bootstraps resample prompts, so the two orders of a prompt always stay together.

Length-controlled win rate (after AlpacaEval 2's length-controlled rate): a logistic regression

    P(first model wins) = sigmoid(theta_0 + theta_1 * tanh(delta_length / sd(delta_length)))

fitted to the per-prompt scores (fractional targets are fine for the logistic likelihood). The
LC win rate is the fitted rate at delta_length = 0, i.e. sigmoid(theta_0): how often the first
model would win if its answers were as long as the second's. Only the slope is ridge-penalised
(`_SLOPE_RIDGE`), which keeps the fit finite when length separates wins from losses and leaves
the intercept, and so LC, exactly the raw rate when all length differences are zero.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
from scipy.special import expit, logit
from scipy.stats import binomtest

_MAX_BOOTSTRAP_ELEMENTS = 2_000_000  # resamples x prompts per chunk: bounds memory for large eval sets
_SLOPE_RIDGE = 1e-3
_MAX_LOGIT = 30.0


def win_rate(n_win: int, n_loss: int, n_tie: int) -> float | None:
    """(W + 0.5 T) / (W + L + T), or None when there is nothing to rate."""
    n = n_win + n_loss + n_tie
    return None if n == 0 else (n_win + 0.5 * n_tie) / n


def standard_error(scores: np.ndarray) -> float | None:
    """Standard error of the mean per-prompt score: sample sd (ddof=1) / sqrt(n). None below 2 prompts."""
    n = len(scores)
    return None if n < 2 else float(np.std(scores, ddof=1) / np.sqrt(n))


def bootstrap_index_chunks(n: int, resamples: int, seed: int) -> Iterator[np.ndarray]:
    """Yields (chunk, n) arrays of prompt indices drawn with replacement, `resamples` rows in all.

    The same (n, resamples, seed) always gives the same rows, so every statistic of one report
    is computed on the same bootstrap samples.
    """
    rng = np.random.default_rng(seed)
    chunk = max(1, _MAX_BOOTSTRAP_ELEMENTS // max(n, 1))
    for start in range(0, resamples, chunk):
        yield rng.integers(0, n, size=(min(chunk, resamples - start), n))


def percentile_interval(samples: np.ndarray, confidence: float) -> tuple[float, float]:
    alpha = (1.0 - confidence) / 2.0
    low, high = np.quantile(samples, [alpha, 1.0 - alpha])
    return float(low), float(high)


def bootstrap_mean_ci(scores: np.ndarray, resamples: int, confidence: float, seed: int) -> tuple[float, float] | None:
    """Percentile bootstrap CI of the mean of `scores` (one value per prompt). None when empty."""
    if len(scores) == 0:
        return None
    means = np.concatenate([scores[idx].mean(axis=1) for idx in bootstrap_index_chunks(len(scores), resamples, seed)])
    return percentile_interval(means, confidence)


def length_feature(len_a: np.ndarray, len_b: np.ndarray) -> np.ndarray:
    """tanh(delta / sd(delta)) with delta = len_a - len_b; all zeros when the differences do not vary."""
    delta = np.asarray(len_a, dtype=float) - np.asarray(len_b, dtype=float)
    sd = float(np.std(delta))
    return np.zeros_like(delta) if sd == 0.0 else np.tanh(delta / sd)


def fit_length_logistic(x: np.ndarray, y: np.ndarray, iterations: int = 100) -> tuple[np.ndarray, np.ndarray]:
    """Newton-Raphson fits of y ~ sigmoid(theta_0 + theta_1 x), batched over rows.

    x, y: (batch, n) features and targets in [0, 1]. Returns (theta_0, theta_1), each (batch,).
    """
    x = np.atleast_2d(x)
    y = np.atleast_2d(y)
    theta0 = logit(np.clip(y.mean(axis=1), 1e-9, 1 - 1e-9))
    theta1 = np.zeros(len(x))
    for _ in range(iterations):
        p = expit(theta0[:, None] + theta1[:, None] * x)
        w = p * (1.0 - p)
        r = y - p
        g0 = r.sum(axis=1)
        g1 = (r * x).sum(axis=1) - _SLOPE_RIDGE * theta1
        h00 = w.sum(axis=1) + 1e-12
        h01 = (w * x).sum(axis=1)
        h11 = (w * x * x).sum(axis=1) + _SLOPE_RIDGE
        det = np.maximum(h00 * h11 - h01 * h01, 1e-300)
        new0 = np.clip(theta0 + np.clip((h11 * g0 - h01 * g1) / det, -5.0, 5.0), -_MAX_LOGIT, _MAX_LOGIT)
        new1 = np.clip(theta1 + np.clip((h00 * g1 - h01 * g0) / det, -5.0, 5.0), -_MAX_LOGIT, _MAX_LOGIT)
        change = max(np.abs(new0 - theta0).max(), np.abs(new1 - theta1).max())
        theta0, theta1 = new0, new1
        if change < 1e-8:  # converged (or pinned at the clip when wins and losses are separable)
            break
    return theta0, theta1


def length_controlled_win_rate(scores: np.ndarray, len_a: np.ndarray, len_b: np.ndarray) -> float | None:
    """Fitted win rate at equal lengths, sigmoid(theta_0). None when empty."""
    if len(scores) == 0:
        return None
    if np.all(scores == scores[0]):  # nothing for length to explain (and the fit would run off to +-inf)
        return float(scores[0])
    theta0, _ = fit_length_logistic(length_feature(len_a, len_b), scores)
    return float(expit(theta0[0]))


def bootstrap_lc_ci(
    scores: np.ndarray, len_a: np.ndarray, len_b: np.ndarray, resamples: int, confidence: float, seed: int
) -> tuple[float, float] | None:
    """Percentile bootstrap CI of the LC win rate, resampling prompts (the length feature is fixed per prompt)."""
    if len(scores) == 0:
        return None
    if np.all(scores == scores[0]):  # every resample is constant too
        return float(scores[0]), float(scores[0])
    x = length_feature(len_a, len_b)
    rates = [
        expit(fit_length_logistic(x[idx], scores[idx])[0])
        for idx in bootstrap_index_chunks(len(scores), resamples, seed)
    ]
    return percentile_interval(np.concatenate(rates), confidence)


@dataclass(frozen=True)
class SignTest:
    n_first_better: int
    n_second_better: int
    n_same: int
    p_value: float


def sign_test(scores_first: np.ndarray, scores_second: np.ndarray) -> SignTest:
    """Exact two-sided sign test on prompts where the two scores differ.

    With binary outcomes this is McNemar's exact test: only discordant prompts carry information,
    and under no difference each is equally likely to favour either side.
    """
    diff = np.asarray(scores_first) - np.asarray(scores_second)
    plus, minus = int((diff > 0).sum()), int((diff < 0).sum())
    p_value = 1.0 if plus + minus == 0 else float(binomtest(plus, plus + minus, 0.5).pvalue)
    return SignTest(plus, minus, int((diff == 0).sum()), p_value)
