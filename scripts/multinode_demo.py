"""Multi-node RLOO on one machine: a Prefect server, a controller worker and two "node" workers on loopback.

Run through `bash scripts/multinode_demo.sh`. Two process workers of pool `train-nodes`, each in its own working
directory, stand in for two machines that share one output root; `rlhf-pipeline/on-demand` runs with
`launch.num_machines: 2`, so its train task starts one `train-node/node` run on each. State goes under
$MULTINODE_DEMO_DIR (default ./.rloo-multinode), MLflow's store is $MULTINODE_DEMO_DIR/mlflow.db. Everything this
script starts is stopped when it ends. Exit status 0 when the flow run Completed.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
# flows/ is not installed (only rloo_engine is): it is imported from this checkout, as Prefect's workers do.
sys.path.insert(0, str(REPO))
BIN = Path(sys.executable).parent
OVERRIDES = {"launch.num_machines": 2, "launch.num_processes": 2, "launch.nodes.poll_interval_s": 1,
             "launch.nodes.start_timeout_s": 300}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Processes:
    """What this script started, each in its own process group, all stopped on exit."""

    def __init__(self, logs: Path):
        self.logs, self.started = logs, []

    def start(self, name: str, cmd: list[str], env: dict[str, str], cwd: Path) -> subprocess.Popen:
        cwd.mkdir(parents=True, exist_ok=True)
        log = (self.logs / f"{name}.log").open("wb")
        proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        self.started.append((name, proc))
        print(f"  started {name} (pid {proc.pid}, log {self.logs / (name + '.log')})")
        return proc

    def stop_all(self) -> None:
        for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
            for _, proc in reversed(self.started):
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline and any(_group_alive(p) for _, p in self.started):
                time.sleep(0.2)
        left = [name for name, p in self.started if _group_alive(p)]
        print("stopped everything this demo started" if not left else f"could not stop: {left}")


def _group_alive(proc: subprocess.Popen) -> bool:
    proc.poll()
    try:
        os.killpg(proc.pid, 0)
        return True
    except ProcessLookupError:
        return False


def wait_for(url: str, proc: subprocess.Popen, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: the server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(f"{url} did not answer within {timeout:.0f} s")


def prefect(env: dict[str, str], *args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(BIN / "prefect"), "--no-prompt", *args], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)
    if proc.returncode != 0 and args[:2] != ("deployment", "run"):
        raise RuntimeError(f"prefect {' '.join(args)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
    return proc


def demo_files(home: Path, env: dict[str, str]) -> Path:
    """The tiny demo config (smoke assets) and a prefect.yaml deploying it from this checkout; returns the latter."""
    from flows.demo import demo_config, ensure_experiment
    from rloo_engine.demo.assets import build_demo_assets

    assets = build_demo_assets(home / "assets", smoke=True)
    config = demo_config(assets, home, smoke=True)
    config["tracking"]["experiment"] = "rloo-multinode-demo"
    config_path = home / "pipeline_multinode.yaml"
    config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    ensure_experiment(env["MLFLOW_TRACKING_URI"], "rloo-multinode-demo", home / "mlartifacts")
    spec = yaml.safe_load((REPO / "deployments" / "prefect.yaml").read_text())
    spec["build"][0]["flows.deployment_steps.load_pipeline_config"]["path"] = str(config_path)
    spec["pull"][0]["prefect.deployments.steps.set_working_directory"]["directory"] = str(REPO)
    for deployment in spec["deployments"]:
        deployment.pop("schedules", None)  # no nightly run in a demo
        job_env = deployment["work_pool"]["job_variables"]["env"]
        job_env.update(MLFLOW_TRACKING_URI=env["MLFLOW_TRACKING_URI"], RLOO_ACCELERATE_PROFILE="cpu")
    prefect_file = home / "prefect.yaml"
    prefect_file.write_text(yaml.safe_dump(spec, sort_keys=False))
    return prefect_file


def main() -> int:
    home = Path(os.environ.get("MULTINODE_DEMO_DIR", ".rloo-multinode")).resolve()
    (home / "logs").mkdir(parents=True, exist_ok=True)
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_"))}
    env.update(
        PREFECT_HOME=str(home / "prefect"), PREFECT_API_URL=f"http://127.0.0.1:{port}/api",
        PREFECT_SERVER_ANALYTICS_ENABLED="false", DO_NOT_TRACK="1", PREFECT_WORKER_QUERY_SECONDS="2",
        MLFLOW_TRACKING_URI=f"sqlite:///{home / 'mlflow.db'}", MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT="true",
        HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
        PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p),
    )
    os.environ.update(env)  # the asset builder and MLflow client below use the same stores
    procs = Processes(home / "logs")
    try:
        print(f"demo state: {home}")
        print("building the tiny demo assets and config")
        prefect_file = demo_files(home, env)
        print("starting the Prefect server and three workers (a controller and two nodes):")
        server_env = {**env, "PREFECT_API_DATABASE_CONNECTION_URL": f"sqlite+aiosqlite:///{home / 'prefect.db'}"}
        server = procs.start("prefect-server", [str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1",
                                                "--port", str(port)], server_env, home)
        wait_for(f"http://127.0.0.1:{port}/api/health", server)
        for pool in ("gpu-pool", "train-nodes"):  # the controller's pool and the nodes' pool
            prefect(env, "work-pool", "create", pool, "--type", "process", "--overwrite")
        prefect(env, "deploy", "--all", "--prefect-file", str(prefect_file))
        procs.start("controller", [str(BIN / "prefect"), "worker", "start", "--pool", "gpu-pool", "--type",
                                   "process", "--limit", "1", "--name", "controller"], env, home / "controller")
        for node in ("node-a", "node-b"):  # a machine each: its own working directory, one run at a time
            procs.start(node, [str(BIN / "prefect"), "worker", "start", "--pool", "train-nodes", "--type", "process",
                               "--limit", "1", "--name", node], env, home / node)
        print(f"running rlhf-pipeline/on-demand with {json.dumps(OVERRIDES)}")
        run = prefect(env, "deployment", "run", "rlhf-pipeline/on-demand", "--param",
                      f"overrides={json.dumps(OVERRIDES)}", "--watch", "--watch-timeout", "1500", timeout=1600)
        flow_run_id = re.search(r"UUID:\s*([0-9a-f-]{36})", run.stdout).group(1)
        return report(env, flow_run_id)
    finally:
        procs.stop_all()


def report(env: dict[str, str], flow_run_id: str) -> int:
    from mlflow.tracking import MlflowClient
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        state = client.read_flow_run(flow_run_id).state
    print(f"flow run {flow_run_id}: {state.name}" + (f" ({state.message})" if state.name != "Completed" else ""))
    mlflow = MlflowClient(env["MLFLOW_TRACKING_URI"])
    exp = mlflow.get_experiment_by_name("rloo-multinode-demo")
    runs = mlflow.search_runs([exp.experiment_id], filter_string=f"tags.`prefect.flow_run_id` = '{flow_run_id}' "
                              "and tags.`rloo.stage` = 'train'") if exp else []
    if runs:
        params = runs[0].data.params
        hosts = {k: v for k, v in params.items() if k.startswith("node.")}
        print(f"train run {runs[0].info.run_id}: world_size {params.get('world_size')}, num_machines "
              f"{params.get('num_machines')}, nodes {hosts}")
        logs = [a.path for a in mlflow.list_artifacts(runs[0].info.run_id, "logs/nodes")]
        print(f"node logs in the train run: {logs}")
    return 0 if state.name == "Completed" else 1


if __name__ == "__main__":
    sys.exit(main())
