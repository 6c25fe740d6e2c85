"""Issue 41, items 4 and 6: "position bias" only for a judge that prefers a slot (its interval excludes 0), low
agreement between the two orders reported as judge noise, and prompts without a completion counted as failed."""

from __future__ import annotations

import numpy as np
import pytest

from rloo_engine.evaluation import EvalConfig, EvaluationError, run_evaluation
from rloo_engine.evaluation.judges.base import Judgment
from rloo_engine.evaluation.pairings import PairItem, combine_orders
from rloo_engine.evaluation.result_checks import pairing_warnings
from rloo_engine.evaluation.scoring import JudgedItem, summarize_pairing
from rloo_engine.pipeline.tracking import warning_tags
from tests.evaluation.eval_helpers import write_jsonl

N_PROMPTS = 200


def _cfg(tmp_path, **overrides) -> EvalConfig:
    values = {"prompts": str(tmp_path / "prompts.jsonl"), "bootstrap_resamples": 1000, "output_dir": str(tmp_path),
              "judge": {"backend": "python", "function": "tests.evaluation.eval_helpers:prefer_longer"},
              "progress": False, **overrides}
    return EvalConfig.model_validate(values)


def _judged(verdict_ab: np.ndarray, verdict_ba: np.ndarray, cfg: EvalConfig):
    judged = []
    for i, (ab, ba) in enumerate(zip(verdict_ab, verdict_ba, strict=True)):
        item = PairItem("policy_vs_sft", f"p{i}", f"prompt {i}", f"answer a {i}", f"answer b {i}", ("ab", "ba"))
        judgments = {"ab": Judgment("ok", str(ab)), "ba": Judgment("ok", str(ba))}
        judged.append(JudgedItem(item, judgments, combine_orders(item, judgments, cfg.both_orders_rule)))
    return summarize_pairing("policy_vs_sft", "policy", "sft", judged, 0, cfg)


def _noisy_judge(seed: int, p_win: float, cfg: EvalConfig, slot_bias: float = 0.0):
    """Each order judged on its own: model_a's answer wins with probability p_win, whichever slot it sits in
    (with probability `slot_bias` the judge picks slot A regardless)."""
    rng = np.random.default_rng(seed)
    a_wins = rng.random((N_PROMPTS, 2)) < p_win
    by_slot = rng.random((N_PROMPTS, 2)) < slot_bias
    verdict_ab = np.where(by_slot[:, 0] | a_wins[:, 0], "A", "B")  # slot A holds model_a's answer
    verdict_ba = np.where(by_slot[:, 1] | ~a_wins[:, 1], "A", "B")  # slot A holds model_b's answer
    return _judged(verdict_ab, verdict_ba, cfg)


@pytest.mark.parametrize("p_win", [0.55, 0.65])
def test_a_noisy_judge_without_slot_preference_is_not_called_position_biased(tmp_path, p_win):
    cfg = _cfg(tmp_path)
    for seed in range(10):
        r = _noisy_judge(seed, p_win, cfg)
        warnings = pairing_warnings(r, cfg)
        assert r.consistency_rate < cfg.min_consistency  # low agreement: the audit's case
        assert not any("position bias" in w for w in warnings), (seed, warnings)
        noise = [w for w in warnings if "judge noise" in w]
        assert len(noise) == 1 and "slot bias" in noise[0], warnings
        assert r.slot_bias_ci_low == 0.0
        assert list(warning_tags(noise)) == ["evaluation.warning.policy_vs_sft.judge_noise"]


def test_a_judge_that_prefers_a_slot_still_gets_the_position_bias_warning(tmp_path):
    cfg = _cfg(tmp_path)
    for seed in range(10):
        r = _noisy_judge(seed, 0.65, cfg, slot_bias=0.5)
        assert r.slot_bias_ci_low > 0.0
        warnings = pairing_warnings(r, cfg)
        assert any("position bias" in w and "bias-corrected" in w for w in warnings), (seed, warnings)


def _files(tmp_path, n_prompts: int, n_policy: int):
    prompts = [f"question {i}" for i in range(n_prompts)]
    write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": p} for p in prompts])
    write_jsonl(tmp_path / "policy.jsonl", [{"prompt": p, "completion": f"policy says {i} a b"}
                                            for i, p in enumerate(prompts[:n_policy])])
    write_jsonl(tmp_path / "sft.jsonl", [{"prompt": p, "completion": f"sft {i}"} for i, p in enumerate(prompts)])


def test_prompts_without_a_completion_count_against_max_failed_fraction(tmp_path):
    _files(tmp_path, 20, 10)
    cfg = _cfg(tmp_path, pairings=["policy_vs_sft"], policy_completions=str(tmp_path / "policy.jsonl"),
               sft_completions=str(tmp_path / "sft.jsonl"))
    with pytest.raises(EvaluationError) as err:
        run_evaluation(cfg)
    message = str(err.value)
    assert "policy_vs_sft" in message and "10 of 20" in message and "10 missing" in message
    assert "max_failed_fraction" in message
    lenient = _cfg(tmp_path, pairings=["policy_vs_sft"], policy_completions=str(tmp_path / "policy.jsonl"),
                   sft_completions=str(tmp_path / "sft.jsonl"), max_failed_fraction=0.5,
                   output_dir=str(tmp_path / "lenient"))
    report = run_evaluation(lenient)
    assert report.pairings["policy_vs_sft"].n_missing == 10 and report.pairings["policy_vs_sft"].n_valid == 10
    assert any("lack a completion" in w for w in report.warnings)
