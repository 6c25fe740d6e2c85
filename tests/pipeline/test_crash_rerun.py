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


def assert_training_gone(flow_run_id: str, within_s: float = 15.0) -> None:
    """Training dies with its worker: the kernel takes a moment to end (and reap) every rank."""
    deadline = time.monotonic() + within_s
    while training_processes(flow_run_id):
        assert time.monotonic() < deadline, f"training outlived its worker by {within_s} s"
        time.sleep(0.2)


def start_until_checkpoint(deployed, registered_model: str, steps: int) -> tuple[str, Path]:
    """A pipeline run, returned once training has written its first checkpoint."""
    overrides = {"train.max_steps": steps, "train.save_steps": 10, "tracking.registered_model": registered_model}
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
    return flow_run_id, run_dir


def restart_worker(deployed, name: str) -> None:
    """What a supervisor (systemd's Restart=, a Deployment's replicas) does for a worker that died."""
    deployed.worker = start_service(
        name, [str(BIN / "prefect"), "worker", "start", "--pool", "gpu-pool", "--type", "process", "--limit", "1"],
        deployed.services.env, deployed.services.root / "logs")
    deployed.services.services.append(deployed.worker)


def assert_rerun_to_the_end(deployed, flow_run_id: str, run_dir: Path, registered_model: str, steps: int) -> None:
    run = deployed.wait_for_state(flow_run_id, {"Completed", "Failed"}, timeout=600)
    assert run.state.name == "Completed", deployed.failure_report(flow_run_id, None)
    assert run.run_count == 2  # the same flow run, run once more
    with deployed.services.prefect_settings(), deployed.client() as c:
        history = [s.name for s in c.read_flow_run_states(flow_run_id)]
    assert "Crashed" in history and "Rescheduled" in history, history
    client = deployed.services.mlflow()
    runs = deployed.mlflow_runs(flow_run_id)
    assert {stage: client.get_run(r.info.run_id).info.status for stage, r in runs.items()} == dict.fromkeys(
        runs, "FINISHED")
    train = client.get_run(runs["train"].info.run_id)
    assert train.data.tags["rloo.resumed_from"].startswith("checkpoint-")
    logged = [json.loads(line)["step"] for line in (run_dir / "train" / "metrics.jsonl").read_text().splitlines()]
    assert logged == sorted(set(logged)) and logged[-1] == steps  # every logging step once, to the end
    assert [m.step for m in client.get_metric_history(train.info.run_id, "reward")] == logged
    assert len(client.search_model_versions(f"name='{registered_model}'")) == 1  # registered once
    assert "re-run 1 of this flow run (it crashed)" in deployed.logs(flow_run_id)


@pytest.fixture
def automations(deployed):
    deployed.services.cli("automation", "create", "--from-file", str(AUTOMATIONS))
    yield
    for name in ("crash-silent-rloo-flow-runs", "rerun-crashed-rloo-flow-runs"):
        deployed.services.cli("automation", "delete", name, check=False)
    if deployed.worker.proc.poll() is not None:  # the test failed between the kill and the restart
        restart_worker(deployed, "worker-restored")  # the session's later pipeline tests need one


def test_a_killed_worker_takes_its_flow_run_with_it_which_is_rerun_and_never_left_killed(deployed, automations):
    """The worker alone SIGKILLed: Prefect's flow-run process goes with it and reports Crashed itself."""
    flow_run_id, run_dir = start_until_checkpoint(deployed, "tiny-policy-worker-kill", steps=60)
    deployed.worker.proc.send_signal(signal.SIGKILL)
    deployed.worker.proc.wait()
    deployed.wait_for_state(flow_run_id, {"Crashed", "Rescheduled", "Scheduled"}, timeout=60)
    assert_training_gone(flow_run_id)
    client = deployed.services.mlflow()
    runs = deployed.mlflow_runs(flow_run_id)
    for stage in ("pipeline", "train"):  # a dead worker is no cancellation: FAILED with why, not KILLED
        ended = client.get_run(runs[stage].info.run_id)
        assert ended.info.status == "FAILED" and ended.data.tags["rloo.end_reason"].startswith("its Prefect worker died")
    restart_worker(deployed, "worker-after-kill")
    assert_rerun_to_the_end(deployed, flow_run_id, run_dir, "tiny-policy-worker-kill", steps=60)


def test_a_worker_lost_with_everything_it_started_is_found_silent_rerun_and_resumed(deployed, automations):
    """The worker's whole machine or container gone: nobody reports the crash; the heartbeats stop, the first
    automation marks the run Crashed after 90 s, the second runs it again."""
    flow_run_id, run_dir = start_until_checkpoint(deployed, "tiny-policy-rerun", steps=120)
    killed_at = time.monotonic()
    kill_worker_and_everything_it_started(deployed.worker)
    assert_training_gone(flow_run_id)
    restart_worker(deployed, "worker-restarted")
    assert_rerun_to_the_end(deployed, flow_run_id, run_dir, "tiny-policy-rerun", steps=120)
    print(f"killed -> completed in {time.monotonic() - killed_at:.0f} s")
