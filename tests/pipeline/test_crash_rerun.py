"""A worker that dies with its flow run (its container or node gone): the automations of
deployments/automations/rerun-crashed-flow-runs.yaml mark the silent run Crashed and schedule it again; it resumes
training in its own output directory and goes on to evaluation and registration (issue 44)."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import psutil
import pytest

from tests.pipeline.conftest import BIN, REPO_ROOT, start_service
from tests.pipeline.pipeline_helpers import training_processes

pytestmark = pytest.mark.slow
AUTOMATIONS = REPO_ROOT / "deployments" / "automations" / "rerun-crashed-flow-runs.yaml"


def kill_worker_and_everything_it_started(worker) -> None:
    """What a lost container does to a worker: every process in it dies at once, no handler runs."""
    root = psutil.Process(worker.proc.pid)
    victims = [root, *root.children(recursive=True)]
    for p in victims:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    worker.proc.wait()


def test_a_run_whose_worker_died_is_marked_crashed_rerun_and_resumes_to_the_end(deployed):
    deployed.services.cli("automation", "create", "--from-file", str(AUTOMATIONS))
    try:
        overrides = {"train.max_steps": 120, "train.save_steps": 10, "tracking.registered_model": "tiny-policy-rerun"}
        flow_run_id, _ = deployed.run("rlhf-pipeline/on-demand", "--param", f"overrides={json.dumps(overrides)}",
                                      watch=False)
        deadline = time.monotonic() + 300
        run_dir = None
        while not (run_dir and list((run_dir / "train").glob("checkpoint-*"))):
            assert time.monotonic() < deadline, deployed.failure_report(flow_run_id, None)
            runs = deployed.mlflow_runs(flow_run_id)
            if "pipeline" in runs:
                run_dir = Path(runs["pipeline"].data.tags["rloo.output_dir"])
            time.sleep(0.5)
        killed_at = time.monotonic()
        kill_worker_and_everything_it_started(deployed.worker)
        assert not training_processes(flow_run_id), "training outlived its worker"
        # A supervisor (systemd's Restart=, a Deployment's replicas) starts a worker again.
        deployed.worker = start_service(
            "worker-restarted",
            [str(BIN / "prefect"), "worker", "start", "--pool", "gpu-pool", "--type", "process", "--limit", "1"],
            deployed.services.env, deployed.services.root / "logs")
        deployed.services.services.append(deployed.worker)

        # Nobody reports the crash: the run stays Running until its heartbeats have been missing for 90 s.
        run = deployed.wait_for_state(flow_run_id, {"Completed", "Failed"}, timeout=600)
        assert run.state.name == "Completed", deployed.failure_report(flow_run_id, None)
        assert run.run_count == 2  # the same flow run, run once more
        with deployed.services.prefect_settings(), deployed.client() as c:
            history = [s.name for s in c.read_flow_run_states(flow_run_id)]
        assert "Crashed" in history and "Rescheduled" in history, history
        print(f"killed -> completed in {time.monotonic() - killed_at:.0f} s; states {history}")

        client = deployed.services.mlflow()
        runs = deployed.mlflow_runs(flow_run_id)
        assert {stage: client.get_run(r.info.run_id).info.status for stage, r in runs.items()} == dict.fromkeys(
            runs, "FINISHED")
        train = client.get_run(runs["train"].info.run_id)
        assert train.data.tags["rloo.resumed_from"].startswith("checkpoint-")
        logged = [json.loads(line)["step"] for line in (run_dir / "train" / "metrics.jsonl").read_text().splitlines()]
        assert logged == sorted(set(logged)) and logged[-1] == 120  # every logging step once, to the end
        assert [m.step for m in client.get_metric_history(train.info.run_id, "reward")] == logged
        assert len(client.search_model_versions("name='tiny-policy-rerun'")) == 1  # registered once
        logs = deployed.logs(flow_run_id)
        assert "re-run 1 of this flow run (it crashed)" in logs
    finally:
        for name in ("crash-silent-rloo-flow-runs", "rerun-crashed-rloo-flow-runs"):
            deployed.services.cli("automation", "delete", name, check=False)
