"""The train task's side of a multi-node run: start one `train-node` run per machine, wait for all, stop all.

Order: (the vLLM server node, when `launch.vllm_server.placement: node`, until it is healthy) -> rank 0, until it
reports its address -> ranks 1..N-1 with that address -> watch every node run's state each
`launch.nodes.poll_interval_s`. The first failure ends the run: the failed node's state message (its exit cause and
last log lines) is kept, every other node run is cancelled (its worker kills its process group), and the task fails
naming the node that failed first (a node that only lost its peer is named after it). Whatever ends the block,
including a cancel of the flow run, every node run still going is cancelled on the way out.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from prefect import get_run_logger
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey
from prefect.deployments import run_deployment
from prefect.runtime import flow_run as this_flow_run
from prefect.states import Cancelling

from rloo_engine.config_base import ConfigError
from rloo_engine.pipeline import tracking
from rloo_engine.pipeline.config import PipelineConfig
from rloo_engine.pipeline.multinode import (
    ADDRESS_ARTIFACT_KEY,
    TOKEN_NAME,
    NodeFailure,
    NodeReport,
    NodeSpec,
    failure_message,
)
from rloo_engine.pipeline.tracking import RunRef
from rloo_engine.pipeline.train_launch import EngineCrashed

FAILED_STATES = {"FAILED", "CRASHED", "CANCELLED", "CANCELLING"}
SETTLE_S = 3.0  # after a first failure, how long other failures may arrive before the cause is picked
# What a node's state message says when it failed on its input (shared directory, engine config): not retried.
_CONFIG_ERRORS = ("OutputDirNotShared", "EngineConfigError", "ConfigError", "VLLMServerConfigError")


class NodeConfigError(ConfigError):
    """A node failed on its configuration or the shared directory; a retry would fail the same way."""


class NodesFailed(EngineCrashed):
    """A node run failed or crashed; a retry resumes every node from the last checkpoint."""


@dataclass
class Node:
    spec: NodeSpec
    flow_run_id: str
    report: NodeReport | None = None


@dataclass
class NodeLaunch:
    """The node runs of one training attempt; use as a context manager so none outlives it."""

    cfg: PipelineConfig
    run_dir: Path
    train_run: RunRef
    withhold_env: list[str]
    nodes: dict[str, Node] = field(default_factory=dict)
    started_at: float = field(default_factory=time.time)
    token: str = field(default_factory=lambda: uuid.uuid4().hex)

    def __enter__(self) -> NodeLaunch:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / TOKEN_NAME).write_text(self.token)
        return self

    def __exit__(self, *exc) -> None:
        self.cancel(reason="the train task ended")

    # ------------------------------------------------------------ starting
    def spec(self, **fields) -> NodeSpec:
        return NodeSpec(
            num_machines=self.cfg.launch.num_machines,
            output_root=str(Path(self.cfg.output_root).expanduser().resolve()),
            run_dir=str(self.run_dir),
            token=self.token,
            launch=self.cfg.launch.model_dump(mode="json"),
            train_dtype=self.cfg.train.dtype,
            seed=self.cfg.train.seed,
            train_run=self.train_run,
            withhold_env=self.withhold_env,
            **fields,
        )

    def start(self, spec: NodeSpec) -> Node:
        nodes = self.cfg.launch.nodes
        run = run_deployment(
            nodes.deployment,
            parameters={"spec": spec.model_dump(mode="json")},
            flow_run_name=f"{this_flow_run.name or 'train'}-{spec.name}",
            timeout=0,  # returns at once; this task watches the run itself
            job_variables=nodes.job_variables or None,
            tags=["rloo-node"],
        )
        node = Node(spec, str(run.id))
        self.nodes[spec.name] = node
        get_run_logger().info("started %s as flow run %s (%s)", spec.name, run.name, nodes.deployment)
        return node

    def start_server(self, model_path: str) -> str:
        """Starts the vLLM server node; returns its URL once it is healthy."""
        host = self.cfg.launch.vllm_server.host
        if host in ("127.0.0.1", "localhost", "::1"):
            get_run_logger().warning(
                "launch.vllm_server.host is %s: only training nodes on the server's own machine can reach it; set "
                "host: 0.0.0.0 when the nodes are separate machines",
                host,
            )
        node = self.start(self.spec(role="vllm_server", server_model_path=model_path))
        timeout = self.cfg.launch.nodes.start_timeout_s + self.cfg.launch.vllm_server.startup_timeout_s
        report = self.wait_for_report(node, timeout)
        assert report.url is not None
        return report.url

    def start_training(self, config_path: Path, server_url: str | None) -> None:
        rank0 = self.start(self.spec(machine_rank=0, config_path=str(config_path), vllm_server_url=server_url))
        report = self.wait_for_report(rank0, self.cfg.launch.nodes.start_timeout_s)
        for rank in range(1, self.cfg.launch.num_machines):
            self.start(
                self.spec(
                    machine_rank=rank,
                    config_path=str(config_path),
                    main_process_ip=report.address,
                    main_process_port=report.port,
                    vllm_server_url=server_url,
                )
            )
        for node in self.nodes.values():
            self.wait_for_report(node, self.cfg.launch.nodes.start_timeout_s)

    def train(self, config_path: Path, server_url: str | None, log_params: bool) -> None:
        """Starts the training nodes, records their hosts on the train run, and waits for them all."""
        try:
            self.start_training(config_path, server_url)
            hosts = self.hosts()
            tracking.set_tags(self.train_run, {f"rloo.node.{name}.host": host for name, host in hosts.items()})
            if log_params:
                tracking.log_params(self.train_run, {f"node.{name}.host": host for name, host in hosts.items()})
            self.wait()
        except (NodesFailed, NodeConfigError) as err:
            tracking.set_tags(self.train_run, {"rloo.exit_cause": str(err)[:5000]})
            raise

    def wait_for_report(self, node: Node, timeout_s: float) -> NodeReport:
        """The node's address report; fails if it fails first, or if it has not reported within `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        with get_client(sync_client=True) as client:
            while node.report is None:
                artifacts = client.read_artifacts(
                    artifact_filter=ArtifactFilter(
                        flow_run_id=ArtifactFilterFlowRunId(any_=[node.flow_run_id]),
                        key=ArtifactFilterKey(any_=[ADDRESS_ARTIFACT_KEY]),
                    )
                )
                if artifacts:
                    node.report = NodeReport(**json.loads(artifacts[0].data)[0])
                    break
                self.raise_if_failed(client)
                if time.monotonic() > deadline:
                    state = client.read_flow_run(node.flow_run_id).state
                    raise NodesFailed(
                        f"launch.nodes.start_timeout_s: {node.spec.name} did not start within {timeout_s:.0f} s "
                        f"(its flow run is {state.name if state else 'unknown'}). Is a worker of the "
                        f"`{self.cfg.launch.nodes.deployment}` deployment's work pool free, one per machine?"
                    )
                time.sleep(self.cfg.launch.nodes.poll_interval_s)
        get_run_logger().info("%s reported host %s, address %s", node.spec.name, node.report.host, node.report.address)
        return node.report

    # ------------------------------------------------------------ watching
    def wait(self) -> None:
        """Returns when every training node's run Completed; raises as soon as one fails (after cancelling the
        rest). The server node runs until `cancel`."""
        trainers = [n for n in self.nodes.values() if n.spec.role == "train"]
        with get_client(sync_client=True) as client:
            while True:
                self.raise_if_failed(client)
                states = [client.read_flow_run(n.flow_run_id).state for n in trainers]
                if all(s is not None and s.type.value == "COMPLETED" for s in states):
                    return
                time.sleep(self.cfg.launch.nodes.poll_interval_s)

    def raise_if_failed(self, client) -> None:
        failures = self._failures(client)
        if not failures:
            return
        time.sleep(SETTLE_S)  # a peer's failure usually follows within a second or two; collect it too
        failures = self._failures(client)
        message = failure_message(failures)
        get_run_logger().error("a node failed; cancelling the others:\n%s", message)
        self.cancel(reason=f"{failures[0].node} failed")
        if any(name in f.message for f in failures for name in _CONFIG_ERRORS):
            raise NodeConfigError(message)
        raise NodesFailed(message)

    def _failures(self, client) -> list[NodeFailure]:
        found = []
        for node in self.nodes.values():
            state = client.read_flow_run(node.flow_run_id).state
            if state is not None and state.type.value in FAILED_STATES:
                found.append(
                    NodeFailure(
                        node=node.spec.name,
                        host=node.report.host if node.report else None,
                        state=state.name,
                        message=state.message or "",
                        seconds=state.timestamp.timestamp() - self.started_at,
                    )
                )
        return found

    def cancel(self, reason: str) -> None:
        """Cancels every node run not yet final and waits (launch.nodes.cancel_timeout_s) for their workers to stop
        them; their process groups are killed on their machines."""
        with get_client(sync_client=True) as client:
            pending = []
            for node in self.nodes.values():
                state = client.read_flow_run(node.flow_run_id).state
                if state is None or not state.is_final():
                    client.set_flow_run_state(node.flow_run_id, Cancelling(message=reason), force=True)
                    pending.append(node)
            deadline = time.monotonic() + self.cfg.launch.nodes.cancel_timeout_s
            while pending and time.monotonic() < deadline:
                time.sleep(1.0)
                pending = [n for n in pending if not _final(client.read_flow_run(n.flow_run_id).state)]
            if pending:
                get_run_logger().warning(
                    "node runs %s were not stopped within launch.nodes.cancel_timeout_s",
                    ", ".join(n.spec.name for n in pending),
                )

    def hosts(self) -> dict[str, str]:
        return {name: n.report.host for name, n in self.nodes.items() if n.report}


def _final(state) -> bool:
    return state is not None and state.is_final()
