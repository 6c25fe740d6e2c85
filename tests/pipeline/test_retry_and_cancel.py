"""Failure handling of the training task through a real worker: a retry resumes, a cancel kills the process group."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import psutil
import pytest

from tests.pipeline.pipeline_helpers import training_processes

pytestmark = pytest.mark.slow


def test_retry_resumes_from_the_checkpoint_the_crashed_attempt_left(deployed):
    # The engine exits with code 3 right after step 4 and its checkpoint-4; the retry must continue at step 5.
    overrides = {"launch.env": {"RLOO_ENGINE_CRASH_AT_STEP": "4"}, "tracking.registered_model": "tiny-policy-retry"}
    flow_run_id, cli = deployed.run("rlhf-pipeline/on-demand", "--param", f"overrides={json.dumps(overrides)}")
    assert cli.returncode == 0, cli.stdout + cli.stderr + deployed.worker.log_tail(80)

    train_task = next(t for t in deployed.task_runs(flow_run_id) if t.name.startswith("train_rloo"))
    assert train_task.run_count == 2
    logs = deployed.logs(flow_run_id)
    assert "injected crash" in logs
    assert "attempt 2: resuming from" in logs and "checkpoint-4" in logs

    train = deployed.mlflow_runs(flow_run_id)["train"]
    assert train.info.status == "FINISHED"
    assert train.data.tags["rloo.attempts"] == "2"
    assert train.data.tags["rloo.resumed_from"] == "checkpoint-4"
    # A restart would log steps 2 and 4 twice; a resume logs every step once and reaches max_steps.
    history = deployed.services.mlflow().get_metric_history(train.info.run_id, "reward")
    assert sorted(m.step for m in history) == [2, 4, 6, 8]
    run_dir = Path(deployed.mlflow_runs(flow_run_id)["pipeline"].data.tags["rloo.output_dir"])
    log_text = (run_dir / "train" / "train.log").read_text()
    assert "resumed from" in log_text and "at step 4" in log_text
    steps = [json.loads(line)["step"] for line in (run_dir / "train" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [2, 4, 6, 8]


def _alive(procs: list[psutil.Process]) -> list[psutil.Process]:
    alive = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                alive.append(p)
        except psutil.NoSuchProcess:
            pass
    return alive


def start_long_training(deployed, registered_model: str) -> tuple[str, list[psutil.Process]]:
    """Starts a 5000-step pipeline run without waiting for it; returns (flow run id, its live training
    processes) once the engine is training: its processes exist and it has logged a reward to MLflow."""
    overrides = {"train.max_steps": 5000, "train.save_steps": 0, "tracking.registered_model": registered_model}
    flow_run_id, _ = deployed.run(
        "rlhf-pipeline/on-demand", "--param", f"overrides={json.dumps(overrides)}", watch=False
    )
    client = deployed.services.mlflow()
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        runs = deployed.mlflow_runs(flow_run_id)
        procs = _alive(training_processes(flow_run_id))
        if "train" in runs and procs and client.get_metric_history(runs["train"].info.run_id, "reward"):
            return flow_run_id, procs
        time.sleep(1)
    raise AssertionError(f"training never started:\n{deployed.logs(flow_run_id)}\n{deployed.worker.log_tail(80)}")


def test_cancelling_during_training_kills_the_process_group_and_marks_the_run_killed(deployed):
    flow_run_id, procs = start_long_training(deployed, "tiny-policy-cancel")
    client = deployed.services.mlflow()
    assert len(procs) >= 2, "expected the accelerate launcher and the engine process"
    groups = {os.getpgid(p.pid) for p in procs}
    assert len(groups) == 1 and groups != {os.getpgid(deployed.worker.proc.pid)}, "training runs in its own group"

    cancelled_at = time.monotonic()
    deployed.services.cli("flow-run", "cancel", flow_run_id)
    while _alive(procs) and time.monotonic() - cancelled_at < 30:
        time.sleep(0.5)
    assert not _alive(procs), f"still running 30 s after cancel: {[p.pid for p in _alive(procs)]}"
    assert not _alive(training_processes(flow_run_id))

    def train_status() -> str:
        return client.get_run(deployed.mlflow_runs(flow_run_id)["train"].info.run_id).info.status

    while train_status() == "RUNNING" and time.monotonic() - cancelled_at < 30:
        time.sleep(0.5)
    assert train_status() == "KILLED"
    assert deployed.mlflow_runs(flow_run_id)["pipeline"].info.status == "KILLED"
    assert deployed.wait_for_state(flow_run_id, {"Cancelled", "Crashed", "Failed"}).state.name == "Cancelled"


def test_training_counts_as_finished_only_with_final_complete_and_the_last_step_logged(tmp_path):
    from tasks.train import training_finished

    out = tmp_path / "train"
    (out / "final").mkdir(parents=True)
    (out / "config.yaml").write_text("max_steps: 4\n")
    (out / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in (1, 2, 3)))
    assert not training_finished(out, use_peft=False)  # no model in final/ yet
    (out / "final" / "config.json").write_text("{}")
    assert not training_finished(out, use_peft=False)  # step 4 not logged
    (out / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in (1, 2, 3, 4)))
    assert training_finished(out, use_peft=False)
    assert not training_finished(out, use_peft=True)  # a LoRA run's final-merged/ is missing
