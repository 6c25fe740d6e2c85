"""Issue 23, defects 1-4: intervals at small n and near 0/1, the average rule's unit, the slot-bias estimate
without noise inflation, and length strata where LC is not estimable. Simulations are seeded and vectorised."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import beta as beta_dist

from rloo_engine.evaluation import EvalConfig, stats
from rloo_engine.evaluation.judges.base import Judgment
from rloo_engine.evaluation.pairings import PairItem, combine_orders
from rloo_engine.evaluation.result_checks import pairing_warnings
from rloo_engine.evaluation.scoring import JudgedItem, slot_verdict_counts, summarize_pairing


def _cfg(tmp_path, **overrides) -> EvalConfig:
    values = {"prompts": str(tmp_path / "prompts.jsonl"), "bootstrap_resamples": 1000, "output_dir": str(tmp_path),
              "judge": {"backend": "python", "function": "tests.evaluation.eval_helpers:prefer_longer"},
              "progress": False, **overrides}
    return EvalConfig.model_validate(values)


def _item(i: int, orders: tuple, a: str | None = None, b: str | None = None) -> PairItem:
    return PairItem("policy_vs_sft", f"p{i}", f"prompt {i}", a or f"answer a {i}", b or f"answer b {i}", orders)


def _pairing(cfg: EvalConfig, verdicts: list[dict], items: list[PairItem] | None = None):
    """verdicts[i]: {order: "A" | "B" | "tie"} for prompt i ({} for an identical pair)."""
    items = items or [_item(i, tuple(v)) for i, v in enumerate(verdicts)]
    judged = []
    for item, v in zip(items, verdicts, strict=True):
        judgments = {o: Judgment("ok", verdict) for o, verdict in v.items()}
        judged.append(JudgedItem(item, judgments, combine_orders(item, judgments, cfg.both_orders_rule)))
    return summarize_pairing("policy_vs_sft", "policy", "sft", judged, 0, cfg)


@pytest.mark.parametrize("n", [3, 5, 10, 30])
def test_all_prompts_won_give_the_exact_lower_bound_not_a_zero_width_interval(tmp_path, n):
    r = _pairing(_cfg(tmp_path, order_mode="single"), [{"ab": "A"} for _ in range(n)])
    assert r.win_rate == 1.0
    assert r.ci_high == 1.0 and r.ci_low == pytest.approx(0.025 ** (1 / n), abs=1e-9)  # 3 of 3: 0.292
    assert r.ci_low < 0.5 if n == 3 else True


def test_nine_of_ten_gives_the_clopper_pearson_interval(tmp_path):
    r = _pairing(_cfg(tmp_path, order_mode="single"), [{"ab": "A"}] * 9 + [{"ab": "B"}])
    assert (r.ci_low, r.ci_high) == pytest.approx((0.555, 0.997), abs=1e-3)


def _coverage(n: int, p: float, with_ties: bool, sims: int = 2000) -> float:
    """Share of seeded simulations whose interval covers the true mean score p (vectorised draws)."""
    rng = np.random.default_rng(n * 1000 + int(p * 100) + with_ties)
    if with_ties:  # a tie on 20% of prompts, wins such that the mean score is p
        scores = rng.choice([1.0, 0.0, 0.5], size=(sims, n), p=[p - 0.1, 0.9 - p, 0.2])
    else:
        scores = (rng.random((sims, n)) < p).astype(float)
    intervals = [stats.win_rate_ci(row, 0.95) for row in scores]
    return float(np.mean([low <= p <= high for low, high in intervals]))


@pytest.mark.parametrize("n", [3, 10, 100])
@pytest.mark.parametrize("p", [0.5, 0.95])
def test_the_win_rate_interval_covers_at_small_n_and_near_the_boundary(n, p):
    assert _coverage(n, p, with_ties=False) >= 0.93
    if p < 0.9:  # ties need room below p
        assert _coverage(n, p, with_ties=True) >= 0.93


def test_average_rule_with_identical_answers_weighs_each_prompt_once(tmp_path):
    """10 prompts won in both orders, 10 identical pairs: the rate is 0.75, as its CI and the corrected rate say."""
    cfg = _cfg(tmp_path, both_orders_rule="average")
    won = [{"ab": "A", "ba": "B"} for _ in range(10)]
    items = [_item(i, ("ab", "ba")) for i in range(10)] + [_item(10 + i, (), "same", "same") for i in range(10)]
    r = _pairing(cfg, won + [{} for _ in range(10)], items)
    assert r.win_rate == 0.75 == r.bias_corrected_win_rate
    successes = 15.0  # 10 x 1 + 10 x 0.5
    assert (r.ci_low, r.ci_high) == pytest.approx(
        (beta_dist.ppf(0.025, successes, 20 - successes + 1), beta_dist.ppf(0.975, successes + 1, 20 - successes)))
    assert r.ci_low < r.win_rate < r.ci_high
    assert (r.n_win, r.n_tie) == (20, 10)  # counts stay counts of verdicts


def test_average_rule_interval_covers_with_identical_answers(tmp_path):
    """Early in training a third of greedy answers are identical; two-order verdicts, no slot bias."""
    cfg = _cfg(tmp_path, both_orders_rule="average")
    rng = np.random.default_rng(7)
    n, p_content, sims, covered = 60, 0.8, 300, 0
    identical = np.arange(n) < n // 3
    truth = (1 / 3) * 0.5 + (2 / 3) * p_content
    items = [_item(i, (), "same", "same") if identical[i] else _item(i, ("ab", "ba")) for i in range(n)]
    for _ in range(sims):
        a_better = rng.random(n) < p_content
        verdicts = [{} if identical[i] else {"ab": "A" if a_better[i] else "B", "ba": "B" if a_better[i] else "A"}
                    for i in range(n)]
        r = _pairing(cfg, verdicts, items)
        covered += r.ci_low <= truth <= r.ci_high
    assert covered / sims >= 0.93


def _slot_biased_verdicts(rng, n: int, p: float, bias: float, mode: str, tie_rate: float = 0.0) -> list[dict]:
    """Each verdict: slot A with probability `bias` whatever the content, else the content verdict (a's answer
    better on a share p of prompts; a content tie with probability tie_rate)."""
    a_better = rng.random(n) < p
    orders = [("ab", "ba")] * n if mode == "both" else [(("ab",), ("ba",))[int(c)] for c in rng.random(n) < 0.5]
    verdicts = []
    for i in range(n):
        v = {}
        for order in orders[i]:
            if rng.random() < bias:
                v[order] = "A"
            elif rng.random() < tie_rate:
                v[order] = "tie"
            else:
                a_in_slot_a = order == "ab"
                v[order] = "A" if a_better[i] == a_in_slot_a else "B"
        verdicts.append(v)
    return verdicts


@pytest.mark.parametrize("mode", ["single", "both"])
@pytest.mark.parametrize("bias", [0.0, 0.3])
@pytest.mark.parametrize("p", [0.8, 0.95])
def test_the_bias_corrected_interval_covers_with_and_without_slot_bias(tmp_path, mode, bias, p):
    """Through the scoring's own verdict counting; the interval and estimate as summarize_pairing reports them."""
    rule = _cfg(tmp_path, order_mode=mode).both_orders_rule
    rng = np.random.default_rng(int(100 * p) + int(10 * bias) + (mode == "both"))
    sims, covered, estimates = 300, 0, []
    for _ in range(sims):
        verdicts = _slot_biased_verdicts(rng, 100, p, bias, mode)
        judged = []
        for i, v in enumerate(verdicts):
            item, judgments = _item(i, tuple(v)), {o: Judgment("ok", x) for o, x in v.items()}
            judged.append(JudgedItem(item, judgments, combine_orders(item, judgments, rule)))
        scores = np.array([j.outcome.score for j in judged])
        first_slot, counts = slot_verdict_counts(judged)
        low, high = stats.bias_corrected_ci(scores, first_slot, counts, 0.95)
        covered += low <= p <= high
        estimates.append(stats.bias_corrected_rate(scores, first_slot, counts))
    assert covered / sims >= 0.93
    if bias == 0.0:  # |2f - 1| absorbed noise: p = 0.95 single order was 0.979 on average, now near p
        assert np.mean(estimates) == pytest.approx(p, abs=0.015)


def test_the_reported_bias_corrected_interval_is_the_one_simulated(tmp_path):
    cfg = _cfg(tmp_path, order_mode="single")
    r = _pairing(cfg, _slot_biased_verdicts(np.random.default_rng(0), 100, 0.8, 0.3, "single"))
    assert r.slot_bias is not None and r.bias_corrected_ci_low < r.bias_corrected_win_rate < r.bias_corrected_ci_high


def test_ties_do_not_inflate_the_slot_bias_estimate(tmp_path):
    """beta = 0.2 with content ties on half the verdicts: leaving ties out of f gave 0.33."""
    cfg = _cfg(tmp_path)
    rng = np.random.default_rng(3)
    estimates = [_pairing(cfg, _slot_biased_verdicts(rng, 400, 0.5, 0.2, "both", tie_rate=0.5)).slot_bias
                 for _ in range(20)]
    assert np.mean(estimates) == pytest.approx(0.2, abs=0.03)


def test_an_unbiased_judge_gets_a_near_zero_slot_bias():
    rng = np.random.default_rng(11)
    first = rng.integers(0, 2, size=(200, 100)).astype(float)  # one fair verdict per prompt, 200 runs
    estimates = stats.slot_bias(first, np.ones_like(first))
    assert np.mean(estimates) < 0.05  # |2f - 1| averages 0.08 here
    assert np.mean(np.abs(2 * first.mean(axis=1) - 1)) > 0.07


def test_lc_not_estimable_still_shows_how_the_rate_moves_with_length(tmp_path):
    """The policy is longer on every prompt and wins more the longer it is: LC refuses, the strata show it."""
    cfg = _cfg(tmp_path, order_mode="single", length_unit="words")
    n = 30
    items = [_item(i, ("ab",), " ".join(["w"] * (2 + i)), "w") for i in range(n)]
    verdicts = [{"ab": "A" if i >= 10 or i % 2 else "B"} for i in range(n)]
    r = _pairing(cfg, verdicts, items)
    assert r.lc_not_estimable and r.lc_win_rate is None
    strata = r.rate_by_length_difference
    assert [s["n"] for s in strata] == [10, 10, 10]
    assert [s["win_rate"] for s in strata] == [0.5, 1.0, 1.0]
    assert (strata[0]["delta_min"], strata[0]["delta_max"], strata[2]["delta_max"]) == (1, 10, 30)
    warning = next(w for w in pairing_warnings(r, cfg) if "not estimable" in w)
    assert "raw rate by length difference (policy minus sft): +1 to +10 words 50%" in warning
