"""A position-biased judge's warnings reach the MLflow tags and the run summary of a real pipeline run."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.slow


def test_position_bias_warnings_are_mlflow_tags_and_in_the_summary(deployed):
    overrides = {
        "evaluation.judge.function": "tests.pipeline.biased_rules:mostly_first_slot",
        "tracking.registered_model": "tiny-policy-biased-judge",
    }
    flow_run_id, cli = deployed.run("rlhf-pipeline/on-demand", "--param", f"overrides={json.dumps(overrides)}")
    assert cli.returncode == 0, cli.stdout + cli.stderr + deployed.worker.log_tail(80)
    runs = deployed.mlflow_runs(flow_run_id)
    for run in (runs["evaluate"], runs["pipeline"]):
        tag = run.data.tags["evaluation.warning.policy_vs_reference.position_bias"]
        assert "first-slot rate" in tag and "bias-corrected" in tag
        assert int(run.data.tags["evaluation.warnings"]) >= 3  # every pairing is biased
    metrics = runs["evaluate"].data.metrics
    assert 0.0 <= metrics["policy_vs_reference/bias_corrected_win_rate"] <= 1.0
    assert metrics["policy_vs_reference/first_slot_rate"] > 0.8
    summary = {a.key: a for a in deployed.artifacts(flow_run_id)}["rlhf-summary"].data
    assert "### Evaluation warnings" in summary and "position bias" in summary
    assert "bias-corrected" in summary
