"""Evaluation warnings reach the pipeline summary and MLflow tags (issue 10, item 2): no services needed."""

from __future__ import annotations

from rloo_engine.pipeline.run_summary import render_markdown
from rloo_engine.pipeline.tracking import warning_tags

WARNINGS = [
    "policy_vs_reference: position bias: consistency 36.0% < min_consistency 60%; the judge answers by slot ...",
    "policy_vs_reference: length-controlled win rate not estimable: the first model is longer on 16 of 16 prompts",
    "policy_vs_sft: 2 of 16 prompts have no verdict (0 parse_error, 2 api_error); the win rate is over the 14",
]


def _summary() -> dict:
    pairing = {
        "win_rate": 0.57,
        "ci_low": 0.5,
        "ci_high": 0.64,
        "lc_win_rate": None,
        "n": 16,
        "n_valid": 16,
        "n_parse_error": 0,
        "n_api_error": 0,
        "consistency_rate": 0.36,
        "first_slot_rate": 0.76,
        "bias_corrected_win_rate": 0.66,
        "bias_corrected_ci_low": 0.55,
        "bias_corrected_ci_high": 0.78,
        "lc_not_estimable": "the first model is longer on 16 of 16 prompts",
    }
    return {
        "output_dir": "/runs/x",
        "mlflow": {"tracking_uri": "http://m", "experiment_id": "1", "run_id": "abc", "run_url": None},
        "stages": {},
        "error": None,
        "evaluation": {"policy_vs_reference": pairing},
        "evaluation_warnings": WARNINGS,
    }


def test_the_summary_shows_the_bias_corrected_rate_lc_not_estimable_and_every_warning():
    markdown = render_markdown("RLHF pipeline", _summary())
    row = next(line for line in markdown.splitlines() if line.startswith("| policy_vs_reference"))
    assert "not estimable" in row and "66.0% [55.0%, 78.0%]" in row and "76.0%" in row
    assert "### Evaluation warnings" in markdown
    for warning in WARNINGS:
        assert f"- {warning}" in markdown


def test_each_warning_becomes_a_tag_named_by_pairing_and_kind():
    tags = warning_tags(WARNINGS)
    assert set(tags) == {
        "evaluation.warning.policy_vs_reference.position_bias",
        "evaluation.warning.policy_vs_reference.lc_not_estimable",
        "evaluation.warning.policy_vs_sft.failed",
    }
    assert tags["evaluation.warning.policy_vs_reference.position_bias"] == WARNINGS[0]
