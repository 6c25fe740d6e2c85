"""A SIGKILLed flow-run process, through a real worker: training dies with it and both MLflow runs are ended."""

from __future__ import annotations

import signal
import time

import psutil
import pytest

from tests.pipeline.test_retry_and_cancel import _alive, start_long_training

pytestmark = pytest.mark.slow


def test_sigkill_of_the_flow_run_process_ends_training_and_its_mlflow_runs(deployed):
    flow_run_id, procs = start_long_training(deployed, "tiny-policy-sigkill")
    client = deployed.services.mlflow()
    launcher = next(p for p in procs if "accelerate" in " ".join(p.cmdline()) and "launch" in p.cmdline())
    flow_process = psutil.Process(launcher.ppid())  # the flow-run process the worker started
    assert flow_process.pid != deployed.worker.proc.pid

    killed_at = time.monotonic()
    flow_process.send_signal(signal.SIGKILL)
    while _alive(procs) and time.monotonic() - killed_at < 5:
        time.sleep(0.1)
    assert not _alive(procs), f"training outlived the flow-run process: {[p.pid for p in _alive(procs)]}"

    run = deployed.wait_for_state(flow_run_id, {"Crashed", "Failed", "Cancelled", "Completed"})
    assert run.state.name == "Crashed", run.state
    assert "-9" in (run.state.message or "")

    def statuses() -> dict[str, str]:
        runs = deployed.mlflow_runs(flow_run_id)
        return {stage: client.get_run(r.info.run_id).info.status for stage, r in runs.items()}

    while "RUNNING" in statuses().values() and time.monotonic() - killed_at < 60:
        time.sleep(0.5)
    assert statuses()["train"] == "FAILED" and statuses()["pipeline"] == "FAILED", statuses()
    reason = client.get_run(deployed.mlflow_runs(flow_run_id)["train"].info.run_id).data.tags["rloo.end_reason"]
    assert reason.startswith("the Prefect flow run crashed: ")
    train_task = next(t for t in deployed.task_runs(flow_run_id) if t.name.startswith("train_rloo"))
    print(f"flow run: {run.state.name}: {run.state.message!r}; train_rloo task run: {train_task.state.name}; "
          f"MLflow runs: {statuses()}; end_reason: {reason!r}")
