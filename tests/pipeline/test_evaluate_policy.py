"""The evaluation-only deployment, and the digest cache of checkpoint ingestion."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.pipeline.pipeline_helpers import REPO_ROOT

pytestmark = pytest.mark.slow


def test_evaluating_the_sft_model_against_itself_ties_and_reuses_the_cached_inspection(deployed):
    sft = deployed.config["sft"]["source"]
    flow_run_id, cli = deployed.run("evaluate-policy/on-demand", "--param", f"policy={sft}")
    assert cli.returncode == 0, cli.stdout + cli.stderr + deployed.worker.log_tail(80)

    runs = deployed.mlflow_runs(flow_run_id)
    assert set(runs) == {"pipeline", "ingest", "ingest_policy", "evaluate"}
    metrics = runs["evaluate"].data.metrics
    # Same weights, greedy decoding: identical completions, every prompt a tie decided without the judge.
    assert metrics["policy_vs_sft/win_rate"] == 0.5
    assert metrics["policy_vs_sft/n_identical"] == 16
    assert runs["ingest"].data.params["sft.digest"] == runs["ingest_policy"].data.params["policy.digest"]

    inspections = sorted(
        (t for t in deployed.task_runs(flow_run_id) if t.name.startswith("inspect_checkpoint")),
        key=lambda t: t.expected_start_time,
    )
    assert len(inspections) == 2
    # Same digest: the second ingestion is served from the cache (or both are, after an earlier test run).
    assert inspections[1].state.name == "Cached"
    assert any(a.key == "rlhf-summary" for a in deployed.artifacts(flow_run_id))


def test_flows_run_from_the_command_line_and_print_the_summary(deployed):
    sft = deployed.config["sft"]["source"]
    cmd = [
        sys.executable,
        "-m",
        "flows.evaluate_policy",
        "--config",
        str(deployed.config_path),
        "--policy",
        sft,
        "--set",
        "evaluation.num_samples=4",
        "--json",
    ]
    proc = subprocess.run(cmd, env=deployed.services.env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout)
    assert summary["evaluation"]["policy_vs_sft"]["win_rate"] == 0.5
    assert summary["evaluation"]["policy_vs_sft"]["n"] == 4  # --set reached the config
    assert set(summary["stages"]) == {"ingest", "ingest_policy", "evaluate"}
    parent = deployed.services.mlflow().get_run(summary["mlflow"]["run_id"])
    assert parent.data.tags["prefect.deployment"] == "none"
    assert summary["mlflow"]["run_url"].startswith(deployed.services.mlflow_uri)
