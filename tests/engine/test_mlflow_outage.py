"""A tracking server that fails mid-request, goes down and comes back, or stays down: training never stops, nothing
logged is lost, and the run's MLflow status ends true (issue 44). A real `mlflow server`, behind a proxy that can
cut its answers (`rloo_engine.testing.flaky_proxy`)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import mlflow
import pytest

from rloo_engine.mlflow_sender import PENDING_FILE
from rloo_engine.services import free_port
from rloo_engine.testing.flaky_proxy import FlakyProxy
from tests.engine.helpers import REPO, prompt_file, repo_pythonpath

BIN = Path(sys.executable).parent


class MlflowServer:
    def __init__(self, root: Path):
        self.root, self.port, self.proc = root, free_port(), None

    def start(self) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
        log = (self.root / "mlflow.log").open("ab")
        self.proc = subprocess.Popen(
            [str(BIN / "mlflow"), "server", "--backend-store-uri", f"sqlite:///{self.root / 'mlflow.db'}",
             "--artifacts-destination", str(self.root / "artifacts"), "--host", "127.0.0.1", "--port", str(self.port),
             "--workers", "1"], env={**env, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}, stdout=log,
            stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2):
                    return
            except OSError:
                time.sleep(0.5)
        raise TimeoutError("mlflow server did not start")

    def kill(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


@pytest.fixture
def tracking(tmp_path):
    server = MlflowServer(tmp_path)
    server.start()
    proxy = FlakyProxy(server.port)
    yield server, proxy
    proxy.close()
    if server.proc.poll() is None:
        server.kill()


def start_training(tmp_path, model, proxy, steps: int) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": repo_pythonpath(), "MLFLOW_TRACKING_URI": proxy.url,
           "RLOO_MLFLOW_CLOSE_TIMEOUT_S": "10"}
    env.pop("MLFLOW_RUN_ID", None)
    cmd = [sys.executable, "-m", "rloo_engine", "train", "--model_name_or_path", str(model), "--dataset_name",
           str(prompt_file(tmp_path)), "--reward_funcs", "tests.engine.helpers:slow_target_reward", "--output_dir",
           str(tmp_path / "out"), "--num_generations", "2", "--per_device_train_batch_size", "4",
           "--max_completion_length", "4", "--max_steps", str(steps), "--logging_steps", "1", "--disable_tqdm"]
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for_step(tmp_path, step: int, proc) -> None:
    path = tmp_path / "out" / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if path.exists() and any(json.loads(line)["step"] >= step for line in path.read_text().splitlines() if line):
            return
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        time.sleep(0.1)
    raise TimeoutError(f"step {step} not logged")


def the_run(server):
    client = mlflow.MlflowClient(f"http://127.0.0.1:{server.port}")
    run_id = json.loads((server.root / "out" / "mlflow_run.json").read_text())["run_id"]
    return client, client.get_run(run_id)


def test_a_server_that_cuts_answers_then_dies_and_comes_back_costs_nothing(tmp_path, qwen2_model, tracking):
    server, proxy = tracking
    proc = start_training(tmp_path, qwen2_model, proxy, steps=14)
    wait_for_step(tmp_path, 2, proc)
    proxy.mode = "cut"  # answers cut mid-body: ChunkedEncodingError in the client
    wait_for_step(tmp_path, 4, proc)
    proxy.mode = "forward"
    server.kill()  # and then the server is gone
    wait_for_step(tmp_path, 6, proc)
    server.start()  # restarted on the same store
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr[-3000:]
    assert proxy.cut_requests > 0
    assert "Traceback" not in stderr
    warnings = [line for line in stderr.splitlines() if "MLflow did not take" in line]
    assert len(warnings) == 1 and "training goes on" in warnings[0], stderr[-3000:]
    assert sum("MLflow answers again" in line for line in stderr.splitlines()) == 1, stderr[-4000:]
    client, run = the_run(server)
    assert [m.step for m in client.get_metric_history(run.info.run_id, "reward")] == list(range(1, 15))
    assert run.info.status == "FINISHED"
    assert {"config.yaml", "metrics.jsonl", "completions.json"} - {a.path for a in
                                                                  client.list_artifacts(run.info.run_id)} <= {"completions.json"}
    assert not (tmp_path / "out" / PENDING_FILE).exists()


def test_a_server_down_for_the_rest_of_the_run_is_reported_and_synced_later(tmp_path, qwen2_model, tracking):
    server, proxy = tracking
    proc = start_training(tmp_path, qwen2_model, proxy, steps=6)
    wait_for_step(tmp_path, 2, proc)
    server.kill()
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr[-3000:]  # training finished; the tracking gap is reported, not fatal
    assert "Traceback" not in stderr
    out = tmp_path / "out"
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == list(range(1, 7))
    last = [line for line in stderr.splitlines() if "did not take" in line][-1]
    assert "the FINISHED status" in last and f"rloo-engine mlflow-sync {out}" in last
    assert (out / PENDING_FILE).is_file()
    server.start()
    env = {**os.environ, "PYTHONPATH": repo_pythonpath()}
    synced = subprocess.run([sys.executable, "-m", "rloo_engine", "mlflow-sync", str(out)], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=300)
    assert synced.returncode == 0, synced.stderr[-3000:]
    client, run = the_run(server)
    assert [m.step for m in client.get_metric_history(run.info.run_id, "reward")] == list(range(1, 7))
    assert run.info.status == "FINISHED"
    assert {"config.yaml", "metrics.jsonl"} <= {a.path for a in client.list_artifacts(run.info.run_id)}
    assert not (out / PENDING_FILE).exists()
