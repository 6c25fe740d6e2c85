"""Real services for the pipeline tests: an MLflow server (SQLite), a Prefect server, deployments and a worker.

Everything lives in the session's temp dir and on free loopback ports; nothing is mocked. Services
start in their own process groups, are polled until they answer, and their groups are killed at
the end of the session. Start-up costs ~30 s once per session (servers start concurrently).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from rloo_engine.testing import tiny_models
from tests.pipeline.pipeline_helpers import REPO_ROOT, tiny_pipeline_config
from tests.services import Service, free_port, start_service, wait_until_ready

BIN = Path(sys.executable).parent


# ---------------------------------------------------------------- services


@dataclass
class Services:
    mlflow_uri: str
    prefect_api_url: str
    env: dict[str, str]  # environment for every client process (CLI, worker, flow runs)
    root: Path
    services: list[Service] = field(default_factory=list)

    def cli(self, *args: str, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess:
        """Runs the `prefect` CLI against the test server, from the repository root."""
        proc = subprocess.run(
            [str(BIN / "prefect"), "--no-prompt", *args],
            env=self.env,
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if check and proc.returncode != 0:
            raise AssertionError(f"prefect {' '.join(args)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
        return proc

    def mlflow(self):
        from mlflow.tracking import MlflowClient

        return MlflowClient(tracking_uri=self.mlflow_uri, registry_uri=self.mlflow_uri)

    @contextmanager
    def prefect_settings(self):
        """Points this (pytest) process's Prefect client at the test server; flushes its logs and events on exit."""
        from prefect.events.worker import EventsWorker
        from prefect.logging.handlers import APILogWorker
        from prefect.settings import PREFECT_API_URL, PREFECT_HOME, PREFECT_LOCAL_STORAGE_PATH, temporary_settings

        home = Path(self.env["PREFECT_HOME"])
        with temporary_settings(
            updates={
                PREFECT_API_URL: self.prefect_api_url,
                PREFECT_HOME: home,
                PREFECT_LOCAL_STORAGE_PATH: home / "storage",
            }
        ):
            try:
                yield
            finally:
                # Sent now, while the server is up, not at interpreter exit when it is gone.
                APILogWorker.drain_all(timeout=10)
                EventsWorker.drain_all(timeout=10)


@pytest.fixture(scope="session")
def services(tmp_path_factory) -> Services:
    root = tmp_path_factory.mktemp("services")
    mlflow_port, prefect_port = free_port(), free_port()
    prefect_home = root / "prefect_home"
    prefect_home.mkdir()
    # Nothing from the developer's own Prefect / MLflow / engine set-up leaks into the test services.
    inherited = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_", "RLOO_"))}
    env = {
        **inherited,
        "PREFECT_HOME": str(prefect_home),
        "PREFECT_API_URL": f"http://127.0.0.1:{prefect_port}/api",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_UI_ENABLED": "false",
        "DO_NOT_TRACK": "1",
        "PREFECT_WORKER_QUERY_SECONDS": "1",
        "PREFECT_LOGGING_TO_API_BATCH_INTERVAL": "0.5",
        "MLFLOW_TRACKING_URI": f"http://127.0.0.1:{mlflow_port}",
        "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true",
        "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        # The flow-run processes import the test judge (tests.pipeline.judge_rules) from the checkout.
        "PYTHONPATH": os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p),
    }
    server_env = {**env, "PREFECT_API_DATABASE_CONNECTION_URL": f"sqlite+aiosqlite:///{root / 'prefect.db'}"}
    logs = root / "logs"
    logs.mkdir()
    # The pipeline needs no MLflow server-side jobs (GenAI scorers); skipping their worker pool saves ~8 processes.
    mlflow_env = {**env, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    mlflow_server = start_service(
        "mlflow",
        [
            str(BIN / "mlflow"),
            "server",
            "--backend-store-uri",
            f"sqlite:///{root / 'mlflow.db'}",
            "--artifacts-destination",
            str(root / "mlartifacts"),
            "--host",
            "127.0.0.1",
            "--port",
            str(mlflow_port),
            "--workers",
            "1",
        ],
        mlflow_env,
        logs,
    )
    prefect_server = start_service(
        "prefect-server",
        [
            str(BIN / "prefect"),
            "server",
            "start",
            "--host",
            "127.0.0.1",
            "--port",
            str(prefect_port),
        ],
        server_env,
        logs,
    )
    s = Services(env["MLFLOW_TRACKING_URI"], env["PREFECT_API_URL"], env, root, [mlflow_server, prefect_server])
    try:
        wait_until_ready(mlflow_server, f"{s.mlflow_uri}/health")
        wait_until_ready(prefect_server, f"{s.prefect_api_url}/health")
        yield s
    finally:
        for service in reversed(s.services):
            service.stop()


# ---------------------------------------------------------------- assets and configs


@pytest.fixture(scope="session")
def pipeline_assets(tmp_path_factory, qwen2_model, reward_model) -> dict[str, Path]:
    """Tiny SFT policy and reward model (session fixtures), training prompts, eval prompts with references."""
    root = tmp_path_factory.mktemp("pipeline_assets")
    train = tiny_models.write_prompt_file(root / "train_prompts.jsonl", num_prompts=64)
    rows = []
    for line in tiny_models.synthetic_corpus(16, seed=7):
        words = line.split()
        rows.append({"prompt": " ".join(words[:4]), "reference": " " + " ".join(words[4:] or ["the", "end"])})
    eval_prompts = root / "eval_prompts.jsonl"
    eval_prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {
        "sft": qwen2_model,
        "reward_model": reward_model,
        "train_prompts": train,
        "eval_prompts": eval_prompts,
        "root": root,
    }


# ---------------------------------------------------------------- deployments and a worker


UUID_LINE = re.compile(r"UUID:\s*([0-9a-f-]{36})")


@dataclass
class Deployed:
    services: Services
    config: dict[str, Any]
    config_path: Path
    worker: Service

    def run(
        self, deployment: str, *args: str, watch: bool = True, timeout: float = 300
    ) -> tuple[str, subprocess.CompletedProcess]:
        """`prefect deployment run <deployment> <args> [--watch]`; returns the flow run id and the CLI result."""
        cli_args = ["deployment", "run", deployment, *args] + (
            ["--watch", "--watch-timeout", str(int(timeout))] if watch else []
        )
        proc = self.services.cli(*cli_args, timeout=timeout + 60, check=False)
        match = UUID_LINE.search(proc.stdout)
        if not match:
            raise AssertionError(
                f"no flow run created:\n{proc.stdout}\n{proc.stderr}\nworker log:\n{self.worker.log_tail(80)}"
            )
        return match.group(1), proc

    def client(self):
        from prefect.client.orchestration import get_client

        return get_client(sync_client=True)

    def flow_run(self, flow_run_id: str):
        with self.services.prefect_settings(), self.client() as c:
            return c.read_flow_run(flow_run_id)

    def logs(self, flow_run_id: str) -> str:
        """Every log line of the flow run and its task runs, oldest first."""
        from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

        # Logs are shipped in batches; give the last batch a moment to arrive.
        time.sleep(1.5)
        with self.services.prefect_settings(), self.client() as c:
            logs = c.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])), limit=200)
            text, offset = [entry.message for entry in logs], len(logs)
            while len(logs) == 200:
                logs = c.read_logs(
                    log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])), limit=200, offset=offset
                )
                text += [entry.message for entry in logs]
                offset += len(logs)
        return "\n".join(text)

    def task_runs(self, flow_run_id: str) -> list:
        from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

        with self.services.prefect_settings(), self.client() as c:
            return c.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))

    def artifacts(self, flow_run_id: str) -> list:
        from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

        with self.services.prefect_settings(), self.client() as c:
            return c.read_artifacts(
                artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]))
            )

    def wait_for_state(self, flow_run_id: str, names: set[str], timeout: float = 120):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            run = self.flow_run(flow_run_id)
            if run.state and run.state.name in names:
                return run
            time.sleep(1)
        raise AssertionError(f"flow run {flow_run_id} not in {names} after {timeout} s (now {run.state.name})")

    def failure_report(self, flow_run_id: str, cli, *extra: str) -> str:
        """Why a flow run failed: the train run's exit cause on the first line (pytest's one-line summary shows it),
        what the run printed, the worker's and `extra` logs, and last (where a long CI log keeps its tail) the
        exit cause again and each training node's engine log tail."""
        try:
            runs = self.mlflow_runs(flow_run_id)
        except Exception as err:  # noqa: BLE001 - a report of a failure must not fail itself
            runs = {"error": f"MLflow runs unreadable: {err}"}
        cause = runs["train"].data.tags.get("rloo.exit_cause") if "train" in runs else runs.get("error")
        parts = [f"train exit cause: {' '.join(str(cause).split())[:400]}", cli.stdout, cli.stderr,
                 self.worker.log_tail(80), *extra, f"train exit cause: {cause}"]
        if "rloo.output_dir" in (runs["pipeline"].data.tags if "pipeline" in runs else {}):
            for log in sorted((Path(runs["pipeline"].data.tags["rloo.output_dir"]) / "train" / "nodes").glob("*.log")):
                parts.append(f"--- {log.name} (last 30 lines)\n" + "\n".join(log.read_text().splitlines()[-30:]))
        return "\n".join(parts)

    def mlflow_runs(self, flow_run_id: str) -> dict[str, Any]:
        """{stage: run} of the flow run's MLflow runs; asserts each stage appears once."""
        c = self.services.mlflow()
        exp = c.get_experiment_by_name(self.config["tracking"]["experiment"])
        if exp is None:
            return {}
        runs = c.search_runs([exp.experiment_id], filter_string=f"tags.`prefect.flow_run_id` = '{flow_run_id}'")
        by_stage: dict[str, Any] = {}
        for run in runs:
            stage = run.data.tags["rloo.stage"]
            assert stage not in by_stage, f"two MLflow runs for stage {stage}"
            by_stage[stage] = run
        return by_stage


def test_prefect_yaml(source: Path, config_path: Path, env: dict[str, str]) -> dict[str, Any]:
    """deployments/prefect.yaml with the test config, the test environment and this checkout."""
    spec = yaml.safe_load(source.read_text())
    spec["build"][0]["flows.deployment_steps.load_pipeline_config"]["path"] = str(config_path)
    spec["pull"][0]["prefect.deployments.steps.set_working_directory"]["directory"] = str(REPO_ROOT)
    passthrough = (
        "MLFLOW_TRACKING_URI",
        "PYTHONPATH",
        "HF_HUB_OFFLINE",
        "TRANSFORMERS_OFFLINE",
        "HF_DATASETS_OFFLINE",
        "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT",
        "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR",
    )
    for deployment in spec["deployments"]:
        job_env = deployment["work_pool"]["job_variables"]["env"]
        job_env.update({k: env[k] for k in passthrough})
        job_env["RLOO_ACCELERATE_PROFILE"] = "cpu"
    return spec


test_prefect_yaml.__test__ = False  # a helper, not a test


@pytest.fixture(scope="session")
def deployed(services, pipeline_assets, tmp_path_factory) -> Deployed:
    """Work pool `gpu-pool`, the three deployments from a test variant of deployments/prefect.yaml, one worker."""
    root = tmp_path_factory.mktemp("deployment")
    config = tiny_pipeline_config(pipeline_assets, root / "runs")
    config_path = root / "pipeline_test.yaml"
    config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    prefect_file = root / "prefect.yaml"
    prefect_file.write_text(
        yaml.safe_dump(
            test_prefect_yaml(REPO_ROOT / "deployments" / "prefect.yaml", config_path, services.env), sort_keys=False
        )
    )
    services.cli("work-pool", "create", "gpu-pool", "--type", "process")
    services.cli("work-pool", "create", "train-nodes", "--type", "process")  # the node runs of multi-node tests
    services.cli("deploy", "--all", "--prefect-file", str(prefect_file))
    worker = start_service(
        "worker",
        [str(BIN / "prefect"), "worker", "start", "--pool", "gpu-pool", "--type", "process", "--limit", "1"],
        services.env,
        services.root / "logs",
    )
    services.services.append(worker)
    return Deployed(services, config, config_path, worker)


def start_node_worker(deployed: Deployed, name: str, extra_env: dict[str, str] | None = None) -> Service:
    """A worker of pool `train-nodes` standing in for one machine: its own working directory, one run at a time."""
    workdir = deployed.services.root / name
    workdir.mkdir(exist_ok=True)
    worker = start_service(
        name,
        [str(BIN / "prefect"), "worker", "start", "--pool", "train-nodes", "--type", "process", "--limit", "1",
         "--name", name],
        {**deployed.services.env, **(extra_env or {})},
        deployed.services.root / "logs",
        cwd=workdir,
    )
    deployed.services.services.append(worker)  # stopped at the end of the session at the latest
    return worker
