"""The demo command in smoke mode: the same code path as the full demo, with tiny assets and 4 training steps."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_demo_smoke_prints_summary_and_records_every_stage(tmp_path):
    home = tmp_path / "demo"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "PREFECT_"))}
    # Smoke training lasts about a second. MLflow's monitor publishes a sample only after a full interval, so a
    # monitor thread started late on a loaded machine (CI, beside a pip install) logged nothing at 0.2 s.
    env["MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL"] = "0.05"
    proc = subprocess.run([sys.executable, "-m", "flows.demo", "--smoke", "--home", str(home)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    for line in ("# RLOO demo summary (smoke mode)", "reward (learned RM), start -> end",
                 "gold score (hidden rule, weight 0), start -> end", "win rate policy vs sft",
                 "win rate policy vs reference", "length-controlled", "promotion gate", "MLflow run",
                 "mlflow ui --backend-store-uri", "prefect server start"):
        assert line in out, line

    # every store lives under the demo home
    assert (home / "mlflow.db").is_file() and (home / "prefect" / "prefect.db").is_file()
    client = MlflowClient(f"sqlite:///{home / 'mlflow.db'}")
    exp = client.get_experiment_by_name("rloo-demo")
    runs = client.search_runs([exp.experiment_id])
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    assert len(parents) == 1
    children = {r.data.tags.get("rloo.stage"): r for r in runs if r.data.tags.get("mlflow.parentRunId") == parents[0].info.run_id}
    assert {"ingest", "reward", "train", "evaluate", "register"} <= set(children), sorted(children)
    train, evaluation = children["train"], children["evaluate"]
    assert [m.step for m in client.get_metric_history(train.info.run_id, "reward")] == [2, 4]
    assert "reward_curve.png" in {a.path for a in client.list_artifacts(train.info.run_id)}
    assert {"judgments.json", "results.json"} <= {a.path for a in client.list_artifacts(evaluation.info.run_id)}
    for pairing in ("policy_vs_sft", "policy_vs_reference", "sft_vs_reference"):
        for metric in ("win_rate", "ci_low", "ci_high"):
            assert f"{pairing}/{metric}" in evaluation.data.metrics
    # In smoke mode both models are far shorter than the references, so only policy vs SFT has an
    # estimable length-controlled rate (the others are reported as not estimable, not logged).
    assert "policy_vs_sft/lc_win_rate" in evaluation.data.metrics
    # smoke mode's gate threshold is 0, so the registration path runs too
    assert client.get_model_version_by_alias("rloo-demo-policy", "candidate").run_id is not None
    assert str(home / "mlartifacts") in exp.artifact_location.replace("file://", "")

    # MLflow 3 records: the policy as a LoggedModel of the train run, used by the register run and
    # registered from it; prompt sets as dataset inputs; system metrics; timing metrics in seconds.
    version = client.get_model_version_by_alias("rloo-demo-policy", "candidate")
    model_id = version.source.removeprefix("models:/")
    assert client.get_logged_model(model_id).source_run_id == train.info.run_id == version.run_id
    assert [o.model_id for o in client.get_run(train.info.run_id).outputs.model_outputs] == [model_id]
    assert [i.model_id for i in client.get_run(children["register"].info.run_id).inputs.model_inputs] == [model_id]

    def datasets(run_id):
        return {(d.dataset.name, d.tags[0].value) for d in client.get_run(run_id).inputs.dataset_inputs}

    assert datasets(parents[0].info.run_id) == {("train_prompts", "training"), ("eval_prompts", "evaluation")}
    assert datasets(train.info.run_id) == {("train_prompts", "training")}
    assert datasets(evaluation.info.run_id) == {("eval_prompts", "evaluation")}
    train_metrics = client.get_run(train.info.run_id).data.metrics
    assert any(k.startswith("system/cpu_utilization") for k in train_metrics), sorted(train_metrics)
    assert {"timing/generation_s", "timing/reward_s"} <= set(train_metrics)
    assert not any(k.startswith("timing/") and not k.endswith("_s") for k in train_metrics)
    assert client.get_run(parents[0].info.run_id).data.tags["mlflow.note.content"].startswith("policy_vs_sft win rate ")

    # The summary table has a header, the Prefect command sets the port its UI calls, and captured to a
    # file the asset build prints plain progress lines, not redrawn bars.
    assert "| measure | value |" in out and "| | |" not in out
    # A smoke run's gate (threshold 0) passes whatever the policy learned: the summary says so beside it.
    gate_row = next(ln for ln in out.splitlines() if ln.startswith("| promotion gate |"))
    assert "smoke mode proves the path runs, not that the policy learns" in gate_row, gate_row
    assert "PREFECT_SERVER_API_PORT=4200 .venv/bin/prefect server start" in out
    asset_lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("demo assets")]
    assert asset_lines and len(asset_lines) <= 40 and not any("\r" in ln for ln in asset_lines)
