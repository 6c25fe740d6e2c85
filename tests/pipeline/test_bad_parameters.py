"""A bad parameter fails a deployment run before any training, with the offending field named."""

from __future__ import annotations

import copy
import json

import pytest

pytestmark = pytest.mark.slow


def test_num_generations_1_fails_parameter_validation_before_any_task(deployed):
    cfg = copy.deepcopy(deployed.config)
    cfg["train"]["num_generations"] = 1
    flow_run_id, cli = deployed.run("rlhf-pipeline/on-demand", "--params", json.dumps({"cfg": cfg}))
    assert cli.returncode != 0
    state = deployed.flow_run(flow_run_id).state
    assert state.name == "Failed" and "Validation of flow parameters failed" in state.message
    assert "PipelineConfig.train: num_generations: 1; RLOO needs at least 2" in deployed.logs(flow_run_id)
    assert deployed.task_runs(flow_run_id) == []
    assert deployed.mlflow_runs(flow_run_id) == {}


def test_missing_sft_path_fails_at_ingest_before_training(deployed):
    overrides = {"sft.source": "/does/not/exist/sft"}
    flow_run_id, cli = deployed.run("rlhf-pipeline/on-demand", "--param", f"overrides={json.dumps(overrides)}")
    assert cli.returncode != 0
    assert deployed.flow_run(flow_run_id).state.name == "Failed"
    assert "sft.source: /does/not/exist/sft does not exist" in deployed.logs(flow_run_id)
    assert not any(t.name.startswith("train_rloo") for t in deployed.task_runs(flow_run_id))
    runs = deployed.mlflow_runs(flow_run_id)
    assert set(runs) == {"pipeline", "ingest"}
    assert runs["ingest"].info.status == "FAILED" and runs["pipeline"].info.status == "FAILED"


def test_unknown_option_is_rejected_by_the_server_when_the_run_is_created(deployed):
    cfg = copy.deepcopy(deployed.config)
    cfg["train"]["num_generationz"] = 4
    proc = deployed.services.cli(
        "deployment", "run", "rlhf-pipeline/on-demand", "--params", json.dumps({"cfg": cfg}), check=False
    )
    assert proc.returncode != 0
    assert "num_generationz" in proc.stdout + proc.stderr
    assert "Created flow run" not in proc.stdout
