"""Multi-node training through Prefect: two process workers of pool `train-nodes` stand in for two machines.

Each "node" is a `prefect worker start --pool train-nodes --limit 1` with its own working directory; both see the
one output root (as nodes on a shared filesystem would). One `prefect deployment run 'rlhf-pipeline/on-demand'` with
`launch.num_machines: 2` must train across both, with rank 0's address found, not typed.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest
import torch
import yaml
from safetensors.torch import load_file

from tests.pipeline.conftest import start_node_worker
from tests.pipeline.pipeline_helpers import training_processes

pytestmark = pytest.mark.slow

TWO_NODES = {
    "launch.num_machines": 2,
    "launch.num_processes": 2,
    "launch.nodes.poll_interval_s": 1,
    "launch.nodes.start_timeout_s": 120,
    "train.per_device_train_batch_size": 8,  # each rank's 8 completions are 2 groups of G=4
    "train.save_steps": 2,
}
STRAIGHT: dict[str, dict[str, torch.Tensor]] = {}  # the uninterrupted 2-node run's final weights
# From a node's failure to the flow run's Failed state: the poll (1 s), the settle window (3 s), the other nodes'
# cancellation (their worker polls every second, then kill_grace_seconds 5 s), and Prefect's own bookkeeping.
FAILURE_BOUND_S = 45


@pytest.fixture(scope="module")
def nodes(deployed):
    workers = {name: start_node_worker(deployed, name) for name in ("node-a", "node-b")}
    yield workers
    for worker in workers.values():
        worker.stop()


def run_two_nodes(deployed, nodes, overrides: dict, watch: bool = True):
    flow_run_id, cli = deployed.run(
        "rlhf-pipeline/on-demand", "--param", f"overrides={json.dumps({**TWO_NODES, **overrides})}", watch=watch
    )
    return flow_run_id, cli


def worker_logs(nodes) -> str:
    return "\n".join(f"--- {name}\n{w.log_tail(60)}" for name, w in nodes.items())


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "train" / "final" / "model.safetensors"))


def run_dir_of(deployed, flow_run_id: str) -> Path:
    return Path(deployed.mlflow_runs(flow_run_id)["pipeline"].data.tags["rloo.output_dir"])



def node_flow_runs(deployed, flow_run_id: str) -> list:
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId

    with deployed.services.prefect_settings(), deployed.client() as c:
        return c.read_flow_runs(
            flow_run_filter=FlowRunFilter(parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[flow_run_id]))
        )


def one_machine_run(run_dir: Path, out: Path) -> dict[str, torch.Tensor]:
    """The same engine config, trained by one `accelerate launch` of 2 processes on one machine."""
    from rloo_engine.pipeline.config import LaunchSection
    from rloo_engine.pipeline.train_launch import launch_command

    values = yaml.safe_load((run_dir / "train" / "rloo_config.yaml").read_text())
    values.update(output_dir=str(out))
    config = out.parent / "one_machine.yaml"
    config.write_text(yaml.safe_dump(values))
    cmd = launch_command(LaunchSection(profile="cpu", num_processes=2), config)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return load_file(str(out / "final" / "model.safetensors"))


def test_ddp_on_two_nodes_equals_one_machine_with_two_processes(deployed, nodes, tmp_path):
    flow_run_id, cli = run_two_nodes(deployed, nodes, {"tracking.registered_model": "tiny-policy-2nodes"})
    assert cli.returncode == 0, deployed.failure_report(flow_run_id, cli, worker_logs(nodes))
    assert deployed.flow_run(flow_run_id).state.name == "Completed"

    # Ingest, reward check, training and evaluation each ran once: one MLflow run per stage.
    runs = deployed.mlflow_runs(flow_run_id)
    assert {"pipeline", "ingest", "reward", "train", "evaluate"} <= set(runs)
    train = runs["train"]
    params = train.data.params
    assert params["num_machines"] == "2" and params["world_size"] == "2"
    assert {"node.node-0.host", "node.node-1.host"} <= set(params)
    client = deployed.services.mlflow()
    logged = {a.path for a in client.list_artifacts(train.info.run_id, "logs/nodes")}
    assert logged == {"logs/nodes/node-0.log", "logs/nodes/node-1.log"}
    assert [m.step for m in client.get_metric_history(train.info.run_id, "reward")] == [2, 4, 6, 8]

    # Each node run ran on its own worker; rank 0 reported its address and rank 1 was started with it.
    logs = deployed.logs(flow_run_id)
    assert "node-0 reported host" in logs and "node-1 reported host" in logs
    run_dir = run_dir_of(deployed, flow_run_id)
    node1_log = (run_dir / "train" / "nodes" / "node-1.log").read_text()
    assert "--machine_rank 1 --main_process_ip 127.0.0.1 --main_process_port" in node1_log
    node_runs = node_flow_runs(deployed, flow_run_id)
    assert sorted(r.name.rsplit("-", 2)[-2:] == ["node", r.name[-1]] for r in node_runs) == [True, True]
    ran_on = {
        name: [r.name for r in node_runs if f"Flow run '{r.name}' submitted to infrastructure" in w.log_tail(2000)]
        for name, w in nodes.items()
    }
    assert sorted(len(v) for v in ran_on.values()) == [1, 1], f"each worker runs one node: {ran_on}"

    two_nodes = STRAIGHT["weights"] = final_weights(run_dir)
    one_machine = one_machine_run(run_dir, tmp_path / "one_machine")
    assert two_nodes.keys() == one_machine.keys()
    worst = max((two_nodes[k] - one_machine[k]).abs().max().item() for k in two_nodes)
    # Not bitwise: accelerate gives each process cores / processes-per-node torch threads (2 on a node of one
    # process, 1 with two processes on one machine), so matmuls sum in another order; 8 AdamW steps move the
    # weights by ~1e-2 and turn that rounding into ~1e-6 (measured 1.5e-6).
    assert worst <= 1e-5, f"2 nodes x 1 process vs 1 machine x 2 processes: max |diff| {worst}"
    assert not training_processes(flow_run_id)


def wait_for(predicate, timeout: float, what: str, poll: float = 0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(poll)
    raise AssertionError(f"{what} not within {timeout} s")


def test_a_killed_node_fails_the_run_naming_it_and_a_retry_resumes_to_the_straight_result(deployed, nodes):
    if "weights" not in STRAIGHT:
        pytest.skip("needs the straight 2-node run of the test above")
    overrides = {"launch.retries": 0, "tracking.registered_model": "tiny-policy-2nodes-kill"}
    flow_run_id, _ = run_two_nodes(deployed, nodes, overrides, watch=False)
    train_dir = wait_for(lambda: _train_dir(deployed, flow_run_id), 120, "the run's train directory")
    wait_for(lambda: any(train_dir.glob("checkpoint-*")), 180, "a first checkpoint", poll=0.1)

    def node1_engine():
        return [p for p in training_processes(flow_run_id) if "node-1.rloo_config" in " ".join(p.cmdline())
                and "accelerate" not in " ".join(p.cmdline())]

    victim = node1_engine()
    assert victim, "node 1's engine process is not running"
    os.kill(victim[0].pid, signal.SIGKILL)
    killed_at = time.monotonic()
    run = deployed.wait_for_state(flow_run_id, {"Failed", "Crashed", "Completed"}, timeout=FAILURE_BOUND_S + 30)
    took = time.monotonic() - killed_at
    assert run.state.name == "Failed", run.state
    assert took <= FAILURE_BOUND_S, f"the flow run failed {took:.0f} s after the kill"
    print(f"the flow run was Failed {took:.0f} s after node 1's engine was killed")
    assert "node-1 on" in run.state.message and "killed by SIGKILL" in deployed.logs(flow_run_id)
    assert "node-1 on" in deployed.logs(flow_run_id)
    wait_for(lambda: not training_processes(flow_run_id), 15, "every engine process gone")
    states = {r.name.rsplit("-", 1)[-1]: r.state.name for r in node_flow_runs(deployed, flow_run_id)}
    assert states["1"] == "Failed" and states["0"] in {"Failed", "Cancelled"}, states  # rank 0 may see the loss first
    report = deployed.failure_report(flow_run_id, SimpleNamespace(stdout="", stderr=""))  # what a failed test prints
    assert "node-1 on" in report.splitlines()[0] and "--- node-1.log (last 30 lines)" in report, report[-3000:]
    (Path(os.environ.get("RLOO_TEST_REPORT_DIR", train_dir.parent)) / "node_failure_message.txt").write_text(
        run.state.message
    )

    # The same flow run again: its train task finds the checkpoint and every node resumes from it.
    deployed.services.cli("flow-run", "retry", flow_run_id)
    run = deployed.wait_for_state(flow_run_id, {"Completed", "Failed", "Crashed"}, timeout=300)
    assert run.state.name == "Completed", deployed.logs(flow_run_id)[-3000:]
    assert re.search(r"attempt \d+: resuming from \S+/checkpoint-\d+", deployed.logs(flow_run_id))
    resumed = final_weights(train_dir.parent)
    worst = max((resumed[k] - STRAIGHT["weights"][k]).abs().max().item() for k in resumed)
    assert worst <= 1e-6, f"killed + resumed vs straight 2-node run: max |diff| {worst}"


def _train_dir(deployed, flow_run_id: str) -> Path | None:
    runs = deployed.mlflow_runs(flow_run_id)
    if "pipeline" not in runs:
        return None
    train = Path(runs["pipeline"].data.tags["rloo.output_dir"]) / "train"
    return train if train.is_dir() else None


def test_zero3_on_two_nodes(deployed, nodes):
    overrides = {
        "launch.profile": "deepspeed_zero3",
        "launch.env": {"DS_ACCELERATOR": "cpu"},
        "train.max_steps": 4,
        "tracking.registered_model": "tiny-policy-2nodes-zero3",
    }
    flow_run_id, cli = run_two_nodes(deployed, nodes, overrides)
    assert cli.returncode == 0, deployed.failure_report(flow_run_id, cli, worker_logs(nodes))
    assert deployed.flow_run(flow_run_id).state.name == "Completed"
    run_dir = run_dir_of(deployed, flow_run_id)
    node1_log = (run_dir / "train" / "nodes" / "node-1.log").read_text()
    assert "--deepspeed_multinode_launcher standard" in node1_log
    shards = {p.name for p in (run_dir / "train").rglob("checkpoint-2/**/*zero_pp_rank*")}
    assert {"zero_pp_rank_0_mp_rank_00_model_states.pt", "zero_pp_rank_1_mp_rank_00_model_states.pt"} <= shards
    assert deployed.mlflow_runs(flow_run_id)["train"].data.params["world_size"] == "2"


def test_a_controller_killed_outright_takes_its_nodes_training_with_it(deployed, nodes):
    # A SIGKILLed flow-run process cancels nothing; each node sees its controller's run end and stops itself.
    overrides = {"train.max_steps": 5000, "train.save_steps": 0, "tracking.registered_model": "tiny-policy-orphan"}
    flow_run_id, _ = run_two_nodes(deployed, nodes, overrides, watch=False)
    wait_for(lambda: len(_engines(flow_run_id)) == 2, 180, "both nodes' engine processes", poll=0.5)
    controller = psutil.Process(deployed.worker.proc.pid).children()
    assert len(controller) == 1, controller  # the gpu-pool worker runs one flow run: this one
    controller[0].send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    wait_for(lambda: not training_processes(flow_run_id), 60, "every node's engine gone after the controller died")
    print(f"nodes stopped {time.monotonic() - killed_at:.0f} s after the controller was killed")
    states = wait_for(
        lambda: (s := [r.state.name for r in node_flow_runs(deployed, flow_run_id)]) and all(
            n in {"Failed", "Cancelled", "Crashed"} for n in s) and s,
        60,
        "the node runs ended",
    )
    assert len(states) == 2


def _engines(flow_run_id: str) -> list[psutil.Process]:
    return [p for p in training_processes(flow_run_id) if "accelerate" not in " ".join(p.cmdline())]


def test_a_node_that_does_not_share_the_output_root_fails_before_any_model_loads(deployed, nodes, tmp_path):
    # node-b now sees the output root somewhere else, as a node with a local disk where the shared volume belongs.
    nodes["node-b"].stop()
    elsewhere = tmp_path / "not-shared"
    nodes["node-b"] = start_node_worker(deployed, "node-c", {"RLOO_OUTPUT_ROOT": str(elsewhere)})
    flow_run_id, _ = run_two_nodes(deployed, nodes, {"tracking.registered_model": "tiny-policy-2nodes-unshared"})
    run = deployed.wait_for_state(flow_run_id, {"Failed", "Crashed", "Completed"}, timeout=180)
    assert run.state.name == "Failed"
    message = run.state.message
    assert "does not share the run's output directory" in message and str(elsewhere) in message, message
    assert "nothing was loaded" in message
    train_task = next(t for t in deployed.task_runs(flow_run_id) if t.name.startswith("train_rloo"))
    assert train_task.run_count == 1, "a node without the shared directory is a configuration error: no retry"
    train_dir = run_dir_of(deployed, flow_run_id) / "train"
    assert not list(train_dir.glob("checkpoint-*")) and not (train_dir / "metrics.jsonl").exists()
    wait_for(lambda: not training_processes(flow_run_id), 15, "every engine process gone")
