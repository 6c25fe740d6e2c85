"""Issue 41, item 1: the promotion gate reads the length-controlled rate, so a policy whose only gain is length
does not pass, while an honestly better policy does, whatever its length. The evaluations are simulated with the
library's own scoring (verdicts drawn per order, seeded), then gated as the pipeline gates them."""

from __future__ import annotations

import numpy as np
import pytest

from rloo_engine.evaluation import EvalConfig
from rloo_engine.evaluation.judges.base import Judgment
from rloo_engine.evaluation.pairings import PairItem, combine_orders
from rloo_engine.evaluation.scoring import JudgedItem, summarize_pairing
from rloo_engine.pipeline.config import PromotionGate
from rloo_engine.pipeline.promotion import GATE_PAIRING, promotion_decision
from rloo_engine.pipeline.stage_results import EvalSummary, pairing_summary

N_PROMPTS = 300


def _cfg(tmp_path) -> EvalConfig:
    return EvalConfig.model_validate({
        "prompts": str(tmp_path / "prompts.jsonl"), "bootstrap_resamples": 1000, "output_dir": str(tmp_path),
        "judge": {"backend": "python", "function": "tests.evaluation.eval_helpers:prefer_longer"}, "progress": False})


def _answer(words: int, who: str, i: int, markdown: str = "") -> str:
    return " ".join([f"{who}{i}"] + ["word"] * (words - 1)) + markdown


def _evaluate(tmp_path, seed: int, policy_words: np.ndarray, sft_words: np.ndarray, p_policy: np.ndarray,
              policy_markdown: str = "") -> EvalSummary:
    """policy_vs_sft judged in both orders; in each order the policy's answer wins with probability p_policy."""
    cfg = _cfg(tmp_path)
    rng = np.random.default_rng(seed)
    policy_wins = rng.random((N_PROMPTS, 2)) < p_policy[:, None]
    judged = []
    for i in range(N_PROMPTS):
        item = PairItem(GATE_PAIRING, f"p{i}", f"prompt {i}", _answer(int(policy_words[i]), "policy", i, policy_markdown),
                        _answer(int(sft_words[i]), "sft", i), ("ab", "ba"))
        judgments = {"ab": Judgment("ok", "A" if policy_wins[i, 0] else "B"),  # slot A: the policy's answer
                     "ba": Judgment("ok", "B" if policy_wins[i, 1] else "A")}
        judged.append(JudgedItem(item, judgments, combine_orders(item, judgments, cfg.both_orders_rule)))
    result = summarize_pairing(GATE_PAIRING, "policy", "sft", judged, 0, cfg)
    return EvalSummary(pairings={GATE_PAIRING: pairing_summary(result)}, paired_difference=None, warnings=[],
                       results_path="r.json", judgments_path="j.jsonl", mlflow_run_id="x")


def _length_judge(delta: np.ndarray) -> np.ndarray:
    """Prefers the longer answer, 50/50 at equal length: no preference for content at all."""
    return 0.5 + 0.45 * np.tanh(delta / 8.0)


def _lengths(seed: int, policy_mean: float) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1000 + seed)
    sft = rng.integers(10, 40, N_PROMPTS)
    return np.maximum(1, sft + np.round(rng.normal(policy_mean, 8.0, N_PROMPTS))).astype(int), sft


@pytest.mark.parametrize("seed", range(3))
def test_a_policy_that_is_always_longer_fails_unless_the_raw_rate_is_allowed(tmp_path, seed):
    sft = np.random.default_rng(seed).integers(10, 40, N_PROMPTS)
    policy = sft + np.random.default_rng(seed + 1).integers(1, 20, N_PROMPTS)  # longer on every prompt
    summary = _evaluate(tmp_path, seed, policy, sft, _length_judge(policy - sft))
    result = summary.pairings[GATE_PAIRING]
    assert result["ci_low"] > 0.6  # the raw rate alone would pass the default gate
    decision = promotion_decision(summary, PromotionGate())
    assert not decision.passed and decision.ci_low is None
    assert "length-controlled win rate is not estimable" in decision.reason
    assert "longer on 300 of 300 prompts" in decision.reason and "allow_unadjusted" in decision.reason
    allowed = promotion_decision(summary, PromotionGate(allow_unadjusted=True))
    assert allowed.passed and "gated on the raw rate" in allowed.reason


@pytest.mark.parametrize("seed", range(3))
def test_a_policy_whose_only_gain_is_length_fails_where_lengths_overlap(tmp_path, seed):
    policy, sft = _lengths(seed, policy_mean=4.0)
    summary = _evaluate(tmp_path, seed, policy, sft, _length_judge(policy - sft))
    result = summary.pairings[GATE_PAIRING]
    assert result["lc_not_estimable"] is None and result["ci_low"] > 0.5  # raw passes, LC is estimable
    decision = promotion_decision(summary, PromotionGate())
    assert not decision.passed, decision.reason
    assert decision.reason.startswith("policy_vs_sft length-controlled win rate CI lower bound")
    assert "raw win rate" in decision.reason
    assert promotion_decision(summary, PromotionGate(rate="raw")).passed


@pytest.mark.parametrize("policy_mean", [-8.0, 0.0, 6.0])
@pytest.mark.parametrize("length_bias", [0.0, 0.3])
def test_an_honestly_better_policy_passes_at_any_length(tmp_path, policy_mean, length_bias):
    policy, sft = _lengths(int(policy_mean) + 20, policy_mean)
    content = 0.72  # the policy's answer is better on content; the judge may also like length a bit
    p_policy = np.clip(content + length_bias * np.tanh((policy - sft) / 8.0), 0.0, 1.0)
    summary = _evaluate(tmp_path, 7, policy, sft, p_policy)
    for rate in ("length_controlled", "style_controlled"):
        decision = promotion_decision(summary, PromotionGate(rate=rate))
        assert decision.passed, decision.reason


def test_style_control_holds_markdown_equal_and_the_gate_can_use_it(tmp_path):
    policy, sft = _lengths(5, policy_mean=0.0)
    # the policy adds bold on a random half of the prompts, and the judge prefers bold, not content
    rng = np.random.default_rng(9)
    bold = rng.random(N_PROMPTS) < 0.5
    p_policy = np.where(bold, 0.85, 0.5)
    cfg_words = [_answer(int(w), "policy", i, " **key point**" if b else "") for i, (w, b) in
                 enumerate(zip(policy, bold, strict=True))]
    summary = _evaluate_answers(tmp_path, cfg_words, sft, p_policy)
    result = summary.pairings[GATE_PAIRING]
    assert result["sc_win_rate"] == pytest.approx(0.5, abs=0.07) and result["win_rate"] > 0.62
    assert promotion_decision(summary, PromotionGate(rate="raw")).passed
    decision = promotion_decision(summary, PromotionGate(rate="style_controlled"))
    assert not decision.passed and "style-controlled win rate" in decision.reason


def _evaluate_answers(tmp_path, policy_answers: list[str], sft_words: np.ndarray, p_policy: np.ndarray):
    cfg = _cfg(tmp_path)
    rng = np.random.default_rng(3)
    policy_wins = rng.random((N_PROMPTS, 2)) < p_policy[:, None]
    judged = []
    for i in range(N_PROMPTS):
        item = PairItem(GATE_PAIRING, f"p{i}", f"prompt {i}", policy_answers[i], _answer(int(sft_words[i]), "sft", i),
                        ("ab", "ba"))
        judgments = {"ab": Judgment("ok", "A" if policy_wins[i, 0] else "B"),
                     "ba": Judgment("ok", "B" if policy_wins[i, 1] else "A")}
        judged.append(JudgedItem(item, judgments, combine_orders(item, judgments, cfg.both_orders_rule)))
    result = summarize_pairing(GATE_PAIRING, "policy", "sft", judged, 0, cfg)
    return EvalSummary(pairings={GATE_PAIRING: pairing_summary(result)}, paired_difference=None, warnings=[],
                       results_path="r.json", judgments_path="j.jsonl", mlflow_run_id="x")
