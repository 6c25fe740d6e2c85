"""The evaluation's inputs are checked when the pipeline starts, before any training (issue 10, item 8)."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (
            {"evaluation.judge.function": "tests.pipeline.judge_rules:no_such_rule"},
            "evaluation.judge.function: tests.pipeline.judge_rules:no_such_rule: tests.pipeline.judge_rules has no "
            "attribute 'no_such_rule'",
        ),
        ({"data.reference_column": "no_such_column"}, "data.reference_column: 'no_such_column'"),
    ],
)
def test_a_bad_judge_or_reference_fails_the_run_before_training(deployed, overrides, expected):
    flow_run_id, cli = deployed.run("rlhf-pipeline/on-demand", "--param", f"overrides={json.dumps(overrides)}")
    assert cli.returncode != 0
    assert deployed.flow_run(flow_run_id).state.name == "Failed"
    logs = deployed.logs(flow_run_id)
    assert "evaluation inputs (checked before training)" in logs and expected in logs, logs[-3000:]
    task_names = [t.name for t in deployed.task_runs(flow_run_id)]
    assert any(name.startswith("check_evaluation_inputs") for name in task_names)
    assert not any(name.startswith(("train_rloo", "ingest_sft_checkpoint")) for name in task_names)
    assert "train" not in deployed.mlflow_runs(flow_run_id)
