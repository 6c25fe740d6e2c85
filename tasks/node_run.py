"""The tasks of one node run (flows/train_node.py), on the machine a worker of the nodes' pool runs it on.

`join_run` checks the shared output directory (before anything loads) and reports this node's host and address as
the `rloo-node-address` table artifact of its flow run, which the train task reads. `train_on_this_node` runs this
machine's `accelerate launch`; `serve_vllm_on_this_node` runs `rloo-engine vllm-serve` until it is cancelled.
Either logs its log to the train stage's MLflow run (`logs/nodes/`).
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import yaml
from prefect import get_run_logger, task
from prefect.artifacts import create_table_artifact
from prefect.cache_policies import NO_CACHE
from prefect.settings import PREFECT_API_URL

from rloo_engine.pipeline import tracking
from rloo_engine.pipeline.config import LaunchSection
from rloo_engine.pipeline.environment import child_env
from rloo_engine.pipeline.launcher import (
    LaunchStopped,
    LaunchTimeout,
    ThrottledLineLogger,
    run_in_process_group,
)
from rloo_engine.pipeline.multinode import (
    ADDRESS_ARTIFACT_KEY,
    NodeReport,
    NodeSpec,
    check_token,
    map_path,
    map_paths,
    node_address,
    node_environment,
    node_root,
    wait_for_server_node,
)
from rloo_engine.pipeline.train_launch import RENDEZVOUS_MARGIN_S, launch_command, raise_for_exit, rendezvous_timeout_s
from rloo_engine.pipeline.vllm_server import VLLMServerFailed, running_vllm_server, serve_command
from rloo_engine.services import free_port, group_alive
from tasks.secrets import secret_env
from tasks.train import gpu_slot


def _run_dir(spec: NodeSpec) -> Path:
    return Path(map_path(spec.run_dir, spec.output_root, node_root(spec.output_root, dict(os.environ))))


@task(name="join_run", cache_policy=NO_CACHE)
def join_run(spec: NodeSpec) -> NodeReport:
    """Checks this node sees the run's directory, then reports where the other nodes reach it."""
    host = socket.gethostname()
    check_token(_run_dir(spec), spec.token, spec.name, host)
    address = node_address(dict(os.environ), PREFECT_API_URL.value())
    report = NodeReport(host=host, address=address)
    if spec.role == "train" and spec.machine_rank == 0:
        report.port = spec.main_process_port or free_port(address)
    elif spec.role == "vllm_server":
        server = LaunchSection(**spec.launch).vllm_server
        report.port = server.port or free_port(server.host)
        reachable = address if server.host in ("0.0.0.0", "::") else server.host
        report.url = f"http://{reachable}:{report.port}"
    get_run_logger().info("%s on %s (%s) sees %s", spec.name, host, address, _run_dir(spec))
    return report


def publish_report(report: NodeReport, spec: NodeSpec) -> None:
    create_table_artifact([report.model_dump()], key=ADDRESS_ARTIFACT_KEY, description=f"{spec.name}: where it is")


@task(name="train_on_this_node", cache_policy=NO_CACHE)
def train_on_this_node(spec: NodeSpec, report: NodeReport) -> dict:
    """This machine's `accelerate launch` of the engine, in its own process group; raises with the exit cause."""
    logger = get_run_logger()
    launch = LaunchSection(**spec.launch)
    run_dir = _run_dir(spec)
    root = node_root(spec.output_root, dict(os.environ))
    if spec.vllm_server_url:
        logger.info("waiting for the vLLM server node at %s", spec.vllm_server_url)
        wait_for_server_node(spec.vllm_server_url, launch.vllm_server.startup_timeout_s)
    config_path = Path(map_path(spec.config_path or "", spec.output_root, root))
    values = map_paths(yaml.safe_load(config_path.read_text()), spec.output_root, root)
    node_config = run_dir / "nodes" / f"{spec.name}.rloo_config.yaml"
    node_config.parent.mkdir(parents=True, exist_ok=True)
    node_config.write_text(yaml.safe_dump(values, sort_keys=False))
    rank0_ip = spec.main_process_ip or report.address
    port = spec.main_process_port or report.port
    cmd = launch_command(
        launch, node_config, machine_rank=spec.machine_rank, main_process_ip=rank0_ip, main_process_port=port
    )
    env = node_environment(spec, dict(os.environ), secret_env(launch.secret_env, "launch.secret_env"),
                           address=report.address)
    log_path = run_dir / "nodes" / f"{spec.name}.log"
    logger.info("launching %s: %s", spec.name, " ".join(cmd))
    logger.info("%s: collectives on interface %s (NCCL_SOCKET_IFNAME, GLOO_SOCKET_IFNAME); rank 0 waits up to %d s "
                "for the other machines (launch.nodes.start_timeout_s %.0f s + %d s)", spec.name,
                env.get("NCCL_SOCKET_IFNAME", "chosen by NCCL/gloo"), rendezvous_timeout_s(launch),
                launch.nodes.start_timeout_s, RENDEZVOUS_MARGIN_S)
    try:
        with gpu_slot(launch.gpu_concurrency_limit):  # `{hostname}` is this node's
            outcome = run_in_process_group(
                cmd,
                env=env,
                log_path=log_path,
                on_line=ThrottledLineLogger(logger, launch.log_interval_seconds),
                timeout_seconds=launch.timeout_seconds,
                kill_grace_seconds=launch.kill_grace_seconds,
                stop_when=controller_ended,
            )
    except LaunchTimeout as err:
        raise TimeoutError(f"launch.timeout_seconds: {spec.name} {err}; its process group was killed") from None
    except LaunchStopped as err:
        raise RuntimeError(f"{spec.name} stopped: {err}; its process group was killed") from None
    finally:
        _log_to_train_run(spec, log_path)
    raise_for_exit(outcome.returncode, outcome.tail, log_path)
    return {"node": spec.name, "host": report.host, "seconds": outcome.seconds}


@task(name="serve_vllm_on_this_node", cache_policy=NO_CACHE)
def serve_vllm_on_this_node(spec: NodeSpec, report: NodeReport) -> None:
    """Runs `rloo-engine vllm-serve` until this flow run is cancelled (the train task does so when training ends);
    raises if the server dies first."""
    logger = get_run_logger()
    launch = LaunchSection(**spec.launch)
    server = launch.vllm_server
    log_path = _run_dir(spec) / "nodes" / "vllm-server.log"
    cmd = serve_command(server, spec.server_model_path or "", report.port or 0, dtype=spec.train_dtype, seed=spec.seed)
    withhold = set(spec.withhold_env)
    env = child_env(dict(os.environ), withhold, {**server.env, "PYTHONUNBUFFERED": "1"})
    local_url = f"http://{'127.0.0.1' if server.host in ('0.0.0.0', '::') else server.host}:{report.port}"
    logger.info("starting the vLLM server: %s", " ".join(cmd))
    try:
        with running_vllm_server(
            cmd,
            url=local_url,
            env=env,
            log_path=log_path,
            startup_timeout_s=server.startup_timeout_s,
            kill_grace_seconds=launch.kill_grace_seconds,
        ) as running:
            publish_report(report, spec)
            logger.info("vLLM server healthy at %s (pid %d)", report.url, running.pid)
            while group_alive(running.pid):
                time.sleep(1.0)
                if reason := controller_ended():
                    raise RuntimeError(f"the vLLM server node stopped: {reason}")
            raise VLLMServerFailed(f"the vLLM server node's server at {report.url} exited; its log is {log_path}")
    finally:
        _log_to_train_run(spec, log_path)


def controller_ended() -> str | None:
    """Why this node should stop although nobody cancelled it: the flow run that started it has ended (say its
    process was SIGKILLed, so it could not cancel its nodes), or None while it is still going."""
    from prefect.client.orchestration import get_client
    from prefect.runtime import flow_run

    parent = flow_run.parent_flow_run_id
    if not parent:
        return None
    try:
        with get_client(sync_client=True) as client:
            state = client.read_flow_run(parent).state
    except Exception:  # an API hiccup is no reason to kill hours of training; the next check asks again
        return None
    if state is not None and state.is_final():
        return f"the flow run that started it ({parent}) is {state.name}"
    return None


def _log_to_train_run(spec: NodeSpec, log_path: Path) -> None:
    if spec.train_run is not None:
        tracking.log_artifact(spec.train_run, log_path, "logs/nodes")
