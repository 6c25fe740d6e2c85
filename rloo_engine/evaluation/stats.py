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

LC is only reported where the data can support it (`lc_support_problem`): when one model is
longer on (nearly) every prompt, delta_length = 0 lies outside the data and sigmoid(theta_0) is an
extrapolation that the slope's guess decides; it is then "not estimable", with the reason.

Slot-bias correction (`bias_corrected_rate`): a judge that, with probability beta, picks one slot
whatever the content, and otherwise judges the content, has a first-slot rate f = (1 + beta) / 2
over a set where each model sits in each slot equally often (both orders, or seeded coin flips),
and shrinks the expected rate toward 1/2: E[raw] = 1/2 + (1 - beta) (p - 1/2). So
beta = |2 f - 1| is estimated from the same verdicts, and p = 1/2 + (raw - 1/2) / (1 - beta).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
from scipy.special import expit, logit
from scipy.stats import beta as beta_dist
from scipy.stats import binomtest, norm

_MAX_BOOTSTRAP_ELEMENTS = 2_000_000  # resamples x prompts per chunk: bounds memory for large eval sets
_SLOPE_RIDGE = 1e-3
_MAX_LOGIT = 30.0
_EXACT_BELOW = 50  # prompts: below this the variance is too noisy to lean on
_MAX_EFFECTIVE_N = 10.0


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


def win_rate_ci(scores: np.ndarray, confidence: float) -> tuple[float, float] | None:
    """Interval of the mean per-prompt score: exact (Clopper-Pearson) below `_EXACT_BELOW` prompts, and the same
    Beta quantiles on an effective sample size at or above it.

    A percentile bootstrap collapses to [1, 1] when every prompt is won, at any n: 3 of 3 would pass a
    gate at 0.5. Clopper-Pearson on S = sum(scores) successes of n prompts covers at least `confidence`
    for 0/1 scores at every n and p (3 of 3: [0.29, 1]); fractional scores (ties, averaged orders) vary
    less than 0/1 ones with the same mean, so there it is conservative: 0.99 coverage at 1.3-1.5x the
    bootstrap's width, i.e. about twice the judge calls for the same precision. From `_EXACT_BELOW` prompts
    on, the Beta quantiles take the effective sample size n_eff = p(1 - p) / Var(mean) (Korn and Graubard
    1998): a set of 0/1 scores keeps n_eff = n - 1 (Clopper-Pearson), one with ties gets the larger n it is
    worth. At p = 0 or 1 the variance says nothing and n stays n; n_eff is capped at `_MAX_EFFECTIVE_N` x n,
    so a set that is nearly all ties cannot shrink its interval below half the exact one.
    """
    n = len(scores)
    if n == 0:
        return None
    mean = float(np.mean(scores))
    size = float(n)
    if n >= _EXACT_BELOW and 0.0 < mean < 1.0:
        variance_of_mean = float(np.var(scores, ddof=1)) / n
        cap = _MAX_EFFECTIVE_N * n
        size = cap if variance_of_mean == 0.0 else min(mean * (1.0 - mean) / variance_of_mean, cap)
    return _beta_interval(mean * size, size, 1.0 - confidence)


def _beta_interval(successes: float, size: float, alpha: float) -> tuple[float, float]:
    """Clopper-Pearson's Beta quantiles; a fractional count of successes is taken as it is."""
    low = 0.0 if successes <= 0 else float(beta_dist.ppf(alpha / 2, successes, size - successes + 1))
    high = 1.0 if successes >= size else float(beta_dist.ppf(1 - alpha / 2, successes + 1, size - successes))
    return low, high


def bootstrap_mean_ci(scores: np.ndarray, resamples: int, confidence: float, seed: int) -> tuple[float, float] | None:
    """Percentile bootstrap CI of the mean of `scores` (one value per prompt). None when empty."""
    if len(scores) == 0:
        return None
    means = np.concatenate([scores[idx].mean(axis=1) for idx in bootstrap_index_chunks(len(scores), resamples, seed)])
    return percentile_interval(means, confidence)


def length_feature(len_a: np.ndarray, len_b: np.ndarray) -> np.ndarray:
    """tanh(delta / sd(delta)) with delta = len_a - len_b; all zeros when the differences do not vary."""
    delta = np.asarray(len_a, dtype=float) - np.asarray(len_b, dtype=float)
    sd = float(np.std(delta)) if len(delta) else 0.0
    return np.zeros_like(delta) if sd == 0.0 else np.tanh(delta / sd)


def fit_controlled_logistic(x: np.ndarray, y: np.ndarray, iterations: int = 100) -> tuple[np.ndarray, np.ndarray]:
    """Newton-Raphson fits of y ~ sigmoid(theta_0 + x @ theta), batched over rows; only the slopes are ridged.

    x: (batch, n, k) features, y: (batch, n) targets in [0, 1]. Returns (theta_0 (batch,), slopes (batch, k)).
    """
    batch, n, k = x.shape
    design = np.concatenate([np.ones((batch, n, 1)), x], axis=2)
    ridge = np.full(k + 1, _SLOPE_RIDGE)
    ridge[0] = 1e-12  # the intercept is free: with every feature at 0, sigmoid(theta_0) is the raw rate
    theta = np.zeros((batch, k + 1))
    theta[:, 0] = logit(np.clip(y.mean(axis=1), 1e-9, 1 - 1e-9))
    for _ in range(iterations):
        p = expit(np.einsum("bnk,bk->bn", design, theta))
        gradient = np.einsum("bnk,bn->bk", design, y - p) - ridge * theta * (np.arange(k + 1) > 0)
        hessian = np.swapaxes(design * (p * (1.0 - p))[..., None], 1, 2) @ design + np.diag(ridge)
        step = np.linalg.solve(hessian, gradient[..., None])[..., 0]
        new = np.clip(theta + np.clip(step, -5.0, 5.0), -_MAX_LOGIT, _MAX_LOGIT)
        change = np.abs(new - theta).max()
        theta = new
        if change < 1e-8:  # converged (or pinned at the clip when wins and losses are separable)
            break
    return theta[:, 0], theta[:, 1:]


def fit_length_logistic(x: np.ndarray, y: np.ndarray, iterations: int = 100) -> tuple[np.ndarray, np.ndarray]:
    """y ~ sigmoid(theta_0 + theta_1 x), batched over rows. x, y: (batch, n). Returns (theta_0, theta_1), each (batch,)."""
    theta0, slopes = fit_controlled_logistic(np.atleast_2d(x)[..., None], np.atleast_2d(y), iterations)
    return theta0, slopes[:, 0]


def controlled_win_rate(scores: np.ndarray, features: np.ndarray) -> float | None:
    """Fitted win rate with every feature at 0 (equal length, equal style), sigmoid(theta_0). features: (n, k)."""
    if len(scores) == 0:
        return None
    if np.all(scores == scores[0]):  # nothing for the features to explain (and the fit would run off to +-inf)
        return float(scores[0])
    theta0, _ = fit_controlled_logistic(features[None], scores[None])
    return float(expit(theta0[0]))


def bootstrap_controlled_ci(scores: np.ndarray, features: np.ndarray, resamples: int, confidence: float,
                            seed: int) -> tuple[float, float] | None:
    """Percentile bootstrap CI of the controlled win rate, resampling prompts (features are fixed per prompt)."""
    if len(scores) == 0:
        return None
    if np.all(scores == scores[0]):  # every resample is constant too (zero width): the rate is the raw one, and
        return win_rate_ci(scores, confidence)  # so is its interval (3 of 3 won: [0.29, 1], not [1, 1])
    rates = [expit(fit_controlled_logistic(features[idx], scores[idx])[0])
             for idx in bootstrap_index_chunks(len(scores), resamples, seed)]
    return percentile_interval(np.concatenate(rates), confidence)


def length_controlled_win_rate(scores: np.ndarray, len_a: np.ndarray, len_b: np.ndarray) -> float | None:
    """Fitted win rate at equal lengths, sigmoid(theta_0). None when empty."""
    return controlled_win_rate(scores, length_feature(len_a, len_b)[:, None])


def bootstrap_lc_ci(
    scores: np.ndarray, len_a: np.ndarray, len_b: np.ndarray, resamples: int, confidence: float, seed: int
) -> tuple[float, float] | None:
    """Percentile bootstrap CI of the LC win rate, resampling prompts (the length feature is fixed per prompt)."""
    return bootstrap_controlled_ci(scores, length_feature(len_a, len_b)[:, None], resamples, confidence, seed)


STYLE_ELEMENTS = ("headers", "list_items", "bold")


def style_features(len_a: np.ndarray, len_b: np.ndarray, counts_a: np.ndarray, counts_b: np.ndarray
                   ) -> tuple[np.ndarray, list[str]]:
    """The features of style control (after Arena-Hard's): the LC length feature, then per markdown element
    (`STYLE_ELEMENTS`, counts (n, 3) per side) the normalised difference (a - b) / (a + b), 0 where neither has
    one, scaled to unit sd but not centred, so 0 still means "equally styled". Elements no answer uses are
    left out. Returns ((n, k) features, their names)."""
    columns, names = [length_feature(len_a, len_b)], ["length"]
    counts_a, counts_b = np.asarray(counts_a, dtype=float), np.asarray(counts_b, dtype=float)
    for j, element in enumerate(STYLE_ELEMENTS):
        total = counts_a[:, j] + counts_b[:, j]
        if not total.any():
            continue
        with np.errstate(invalid="ignore", divide="ignore"):
            diff = np.where(total > 0, (counts_a[:, j] - counts_b[:, j]) / total, 0.0)
        sd = float(np.std(diff))
        columns.append(diff / sd if sd > 0 else diff)
        names.append(element)
    return np.stack(columns, axis=1), names


def controlled_fit_problem(scores: np.ndarray, features: np.ndarray) -> str | None:
    """Why the controlled fit on all prompts is ill-conditioned (a coefficient at its bound), or None."""
    if len(scores) == 0 or np.all(scores == scores[0]):
        return None
    theta0, slopes = fit_controlled_logistic(features[None], scores[None])
    if max(abs(theta0[0]), np.abs(slopes[0]).max()) >= _MAX_LOGIT - 1e-6:
        return "the model does not converge (the controlled features separate wins from losses); its intercept is " \
               "unbounded"
    return None


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


def _one_sided(delta: np.ndarray, min_share: float) -> tuple[str, int, int] | None:
    """(side, prompts on it, prompts needed on each side) when fewer than `min_share` of the prompts (and at least
    2) lie on one side of 0, a 0 counting for both; None when 0 lies inside the data."""
    n = len(delta)
    if n == 0 or np.all(delta == 0):
        return None
    longer, shorter = int((delta > 0).sum()), int((delta < 0).sum())
    at_least, at_most = n - shorter, n - longer  # delta >= 0, delta <= 0
    needed = max(2, int(np.ceil(min_share * n)))
    if min(at_least, at_most) >= needed:
        return None
    side = "longer" if at_least > at_most else "shorter"
    return side, longer if side == "longer" else shorter, needed


def lc_support_problem(
    len_a: np.ndarray, len_b: np.ndarray, min_share: float, unit: str, first: str = "the first model"
) -> str | None:
    """Why LC cannot be estimated from these lengths, or None when it can.

    LC is the fitted rate at equal length; it is supported by the data only when at least
    `min_share` of the prompts lie on each side of equal length (a tie in length counts for both).
    """
    delta = np.asarray(len_a, dtype=float) - np.asarray(len_b, dtype=float)
    one_sided = _one_sided(delta, min_share)
    if one_sided is None:
        return None
    side, count, needed = one_sided
    return (
        f"{first} is {side} on {count} of {len(delta)} prompts (length difference {delta.min():+g} to "
        f"{delta.max():+g} {unit}); equal length lies outside the data (lc_min_overlap needs {needed} prompts on "
        "each side), so a rate at equal length would be an extrapolation"
    )


def style_support_problem(features: np.ndarray, names: list[str], min_share: float,
                          first: str = "the first model") -> str | None:
    """Why the style-controlled rate cannot be estimated (a markdown element one model uses more on nearly every
    prompt), or None. Length is checked by `lc_support_problem`."""
    for column, name in zip(features.T, names, strict=True):
        one_sided = _one_sided(column, min_share) if name != "length" else None
        if one_sided is not None:
            side, count, needed = one_sided
            more = "more" if side == "longer" else "fewer"
            return (f"{first} uses {more} {name.replace('_', ' ')} on {count} of {len(column)} prompts; equal style "
                    f"lies outside the data (lc_min_overlap needs {needed} prompts on each side)")
    return None


def length_strata(scores: np.ndarray, len_a: np.ndarray, len_b: np.ndarray, confidence: float,
                  bins: int = 3) -> list[dict]:
    """The raw rate within `bins` equal-count strata of the length difference (len_a - len_b), each with its
    exact interval: what length explains, shown without extrapolating to equal length (LC may refuse to)."""
    delta = np.asarray(len_a, dtype=float) - np.asarray(len_b, dtype=float)
    if len(scores) < 2 * bins or np.all(delta == delta[0]):
        return []
    order = np.argsort(delta, kind="stable")
    strata = []
    for part in np.array_split(order, bins):
        low, high = win_rate_ci(scores[part], confidence)
        strata.append({"delta_min": float(delta[part].min()), "delta_max": float(delta[part].max()),
                       "n": int(len(part)), "win_rate": float(scores[part].mean()), "ci_low": low, "ci_high": high})
    return strata


def lc_fit_problem(scores: np.ndarray, len_a: np.ndarray, len_b: np.ndarray) -> str | None:
    """Why the LC fit on all prompts is ill-conditioned (a coefficient at its bound), or None."""
    problem = controlled_fit_problem(scores, length_feature(len_a, len_b)[:, None])
    return None if problem is None else ("the length model does not converge (length separates wins from losses); "
                                         "its intercept is unbounded")


def first_slot_rate(first_slot: np.ndarray, verdicts: np.ndarray) -> np.ndarray:
    """f = sum(first_slot) / sum(verdicts) over the last axis; NaN where there is no verdict.

    first_slot, verdicts: (..., n_prompts) per prompt, the slot-A verdicts plus half the ties, and all verdicts.
    Ties count half: leaving them out of f would inflate it, since a slot-biased judge's biased picks
    are never ties while its content judgments sometimes are.
    """
    total = np.asarray(verdicts, dtype=float).sum(axis=-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.asarray(first_slot, dtype=float).sum(axis=-1) / total


def slot_bias(first_slot: np.ndarray, verdicts: np.ndarray) -> np.ndarray:
    """beta estimated as sqrt(max(0, (2f - 1)^2 - Var(2f - 1))); NaN where there is no verdict.

    |2f - 1| is never negative, so noise alone makes it positive and the correction then inflates an
    unbiased judge's rate. Subtracting the sampling variance makes beta^2 unbiased; the variance is the
    ratio estimator's, with prompts as clusters (a prompt's two orders are not independent verdicts).
    """
    first_slot, verdicts = np.asarray(first_slot, dtype=float), np.asarray(verdicts, dtype=float)
    f = first_slot_rate(first_slot, verdicts)
    total = verdicts.sum(axis=-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        var_f = ((first_slot - f[..., None] * verdicts) ** 2).sum(axis=-1) / total**2
    return np.sqrt(np.maximum((2.0 * f - 1.0) ** 2 - 4.0 * var_f, 0.0))


def _undo_shrinkage(raw: np.ndarray, beta: np.ndarray) -> np.ndarray:
    with np.errstate(invalid="ignore", divide="ignore"):
        corrected = 0.5 + (raw - 0.5) / (1.0 - beta)
    return np.where(beta < 1.0, np.clip(corrected, 0.0, 1.0), np.nan)


def bias_corrected_rate(scores: np.ndarray, first_slot: np.ndarray, verdicts: np.ndarray) -> float | None:
    """The win rate with the estimated slot bias undone (see the module docstring). None when empty or beta = 1."""
    if len(scores) == 0 or np.sum(verdicts) == 0:
        return None if len(scores) == 0 else float(np.mean(scores))
    value = float(_undo_shrinkage(np.asarray(np.mean(scores)), slot_bias(first_slot, verdicts)))
    return None if np.isnan(value) else value


def slot_bias_interval(first_slot: np.ndarray, verdicts: np.ndarray, confidence: float) -> tuple[float, float]:
    """A normal interval of beta = |2f - 1| from the clustered variance of f, clipped to [0, 1). Its lower bound is
    above 0 only when the first-slot rate differs from 1/2 by more than its sampling noise."""
    first_slot, verdicts = np.asarray(first_slot, dtype=float), np.asarray(verdicts, dtype=float)
    f = float(first_slot_rate(first_slot, verdicts))
    var_f = float(((first_slot - f * verdicts) ** 2).sum() / verdicts.sum() ** 2)
    half = norm.ppf(1 - (1 - confidence) / 2) * 2.0 * np.sqrt(var_f)
    low, high = abs(2 * f - 1) - half, abs(2 * f - 1) + half
    return max(low, 0.0), min(high, 1.0 - 1e-9)


def bias_corrected_ci(
    scores: np.ndarray, first_slot: np.ndarray, verdicts: np.ndarray, confidence: float
) -> tuple[float, float] | None:
    """An interval of the bias-corrected rate that holds `confidence` by Bonferroni: the corrected rate at the
    corners of a (1 - alpha/2) interval of the raw rate and a (1 - alpha/2) interval of beta. The correction is
    monotone in each, so the corners bound it. A percentile bootstrap of the corrected rate undercovered near
    the boundary (0.90 at p = 0.95, 100 prompts), where the clipped estimate is skewed. None when empty."""
    if len(scores) == 0:
        return None
    if np.sum(verdicts) == 0:
        return win_rate_ci(scores, confidence)
    first_slot, verdicts = np.asarray(first_slot, dtype=float), np.asarray(verdicts, dtype=float)
    each = 1.0 - (1.0 - confidence) / 2.0
    raw_low, raw_high = win_rate_ci(scores, each)
    beta_low, beta_high = slot_bias_interval(first_slot, verdicts, each)
    corners = _undo_shrinkage(np.array([raw_low, raw_low, raw_high, raw_high]),
                              np.array([beta_low, beta_high, beta_low, beta_high]))
    return float(corners.min()), float(corners.max())
