"""Multi-node launches without Prefect: what one node run is told, how it finds its paths and address, and how the
failures of several nodes are told apart.

The train task (tasks/train_nodes.py) starts one node run per machine (flows/train_node.py); each runs
`accelerate launch --num_machines N --machine_rank r --main_process_ip <rank 0> ...` on its machine. Rank 0's
address is *reported*, not typed: rank 0's node run picks its address and a free port and reports them, and the
other nodes are started with them. (c10d rendezvous would still need an endpoint every node knows in advance.)

Paths: the controller and the nodes may mount the shared output root at different paths (a Kubernetes volume at
/outputs, the controller's NFS mount elsewhere). A node sees `output_root` at `$RLOO_OUTPUT_ROOT` when that is set
in its environment (a job variable of its work pool), else at the controller's path; every path of the run under
the root is mapped. Before anything loads, each node reads a token the controller wrote into the run's directory:
a node that cannot see the shared filesystem fails at once, naming the path it looked at.
"""

from __future__ import annotations

import re
import socket
import time
import urllib.parse
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel

from rloo_engine.pipeline.tracking import RunRef
from rloo_engine.run.shared_output_dir import VISIBILITY_WAIT_S, OutputDirNotShared
from rloo_engine.services import wait_for_health

NODE_ROOT_ENV = "RLOO_OUTPUT_ROOT"  # where this node sees the run's output_root
NODE_ADDRESS_ENV = "RLOO_NODE_ADDRESS"  # the address other nodes reach this one at (e.g. a pod IP)
TOKEN_NAME = ".rloo-nodes-token"
ADDRESS_ARTIFACT_KEY = "rloo-node-address"


class NodeSpec(BaseModel):
    """Everything one node run needs; a flow parameter, so it holds no secret values (only secret block names)."""

    role: Literal["train", "vllm_server"] = "train"
    machine_rank: int = 0
    num_machines: int
    output_root: str  # as the controller sees it
    run_dir: str  # this train stage's directory, as the controller sees it
    token: str  # what the controller wrote into run_dir/TOKEN_NAME
    launch: dict[str, Any]  # the LaunchSection, as JSON
    config_path: str | None = None  # the engine config (train nodes)
    main_process_ip: str | None = None  # rank 0's address; None on rank 0 itself
    main_process_port: int | None = None
    vllm_server_url: str | None = None  # train nodes wait for its /health before launching
    server_model_path: str | None = None  # the vLLM server node's model
    train_dtype: str = "auto"
    seed: int = 0
    train_run: RunRef | None = None  # the train stage's MLflow run: rank 0 logs metrics, each node its log
    withhold_env: list[str] = []  # environment variables the node's processes must not see (the judge's key)

    @property
    def name(self) -> str:
        return "vllm-server" if self.role == "vllm_server" else f"node-{self.machine_rank}"


class NodeReport(BaseModel):
    """What a node run reports once it checked the shared directory: its host and where others reach it."""

    host: str
    address: str
    port: int | None = None  # rank 0: the rendezvous port; the server node: its HTTP port
    url: str | None = None  # the server node's URL


# ---------------------------------------------------------------- paths


def node_root(controller_root: str, environ: dict[str, str]) -> Path:
    return Path(environ.get(NODE_ROOT_ENV) or controller_root)


def map_path(path: str, controller_root: str, root: Path) -> str:
    """`path` as this node sees it: a path under the controller's output root moves under this node's root."""
    try:
        rel = Path(path).relative_to(controller_root)
    except ValueError:
        return path
    return str(root / rel)


def map_paths(values: Any, controller_root: str, root: Path) -> Any:
    """Every string under the controller's output root in a (nested) config mapped with `map_path`."""
    if isinstance(values, dict):
        return {k: map_paths(v, controller_root, root) for k, v in values.items()}
    if isinstance(values, list):
        return [map_paths(v, controller_root, root) for v in values]
    if isinstance(values, str) and values.startswith(controller_root):
        return map_path(values, controller_root, root)
    return values


def check_token(run_dir: Path, expected: str, node: str, host: str) -> None:
    """Raises OutputDirNotShared, naming this node and the path it read, unless run_dir holds the controller's
    token (waiting out NFS attribute caching first)."""
    path = run_dir / TOKEN_NAME
    deadline = time.monotonic() + VISIBILITY_WAIT_S
    while True:
        try:
            seen = path.read_text().strip()
            problem = None if seen == expected else "holds another run's token"
        except OSError as err:
            problem = f"cannot be read ({type(err).__name__}: {err.strerror or err})"
        if problem is None:
            return
        if time.monotonic() > deadline:
            raise OutputDirNotShared(
                f"output_dir: {node} on {host} does not share the run's output directory: {path} {problem}. Every "
                f"node must see the controller's output root at the same path or at ${NODE_ROOT_ENV} (NFS, Lustre, a "
                "shared volume); nothing was loaded"
            )
        time.sleep(0.2)


# ---------------------------------------------------------------- address


def node_address(environ: dict[str, str], toward: str | None) -> str:
    """The address other machines reach this one at: $RLOO_NODE_ADDRESS, else the local address of the route toward
    `toward` (the Prefect API URL: every node reaches it, so its route's interface is the one peers share)."""
    if environ.get(NODE_ADDRESS_ENV):
        return environ[NODE_ADDRESS_ENV]
    host = urllib.parse.urlparse(toward).hostname if toward else None
    if host:
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.connect((socket.gethostbyname(host), 9))  # UDP connect sends nothing; it only picks the route
                return s.getsockname()[0]
        except OSError:
            pass
    return socket.gethostbyname(socket.gethostname())


# ---------------------------------------------------------------- failures

# What a rank prints when another rank vanished: it failed *because of* another node.
_PEER_LOST = re.compile(
    r"connection (closed|reset) by peer|broken pipe|ProcessGroupGloo.*(timed out|Connection)|"
    r"NCCL (communicator|error).*(abort|remote)|socket timeout|recvBytes|Connection refused|"
    r"DistStoreError|Timed out (after|waiting)|closed the connection|EOF",
    re.IGNORECASE,
)


def lost_a_peer(message: str) -> bool:
    return bool(_PEER_LOST.search(message))


class NodeFailure(BaseModel):
    node: str
    host: str | None
    state: str  # Prefect state name: Failed, Crashed, Cancelled
    message: str
    seconds: float  # since the nodes were started


def failure_message(failures: list[NodeFailure]) -> str:
    """Names the node that failed first of those that did not just lose a peer, then the others."""
    cause = sorted(failures, key=lambda f: (lost_a_peer(f.message), f.seconds))[0]
    where = f" on {cause.host}" if cause.host else ""
    lines = [f"{cause.node}{where} failed ({cause.state}) after {cause.seconds:.0f} s: {cause.message.strip()}"]
    for other in failures:
        if other is not cause:
            lines.append(f"then {other.node} ({other.state}): {_first_line(other.message)}")
    return "\n".join(lines)


def _first_line(text: str) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line if len(line) <= 300 else line[:300] + " ..."


def interface_of(address: str) -> str | None:
    """The network interface holding `address` on this machine, or None."""
    import psutil

    for name, addresses in psutil.net_if_addrs().items():
        if any(a.address == address for a in addresses):
            return name
    return None


# The variables NCCL and gloo pick their network interface from; unset, each may pick another than the nodes share.
SOCKET_IFNAME_VARIABLES = ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")


def node_environment(spec: NodeSpec, base: dict[str, str], secrets: dict[str, str],
                     address: str | None = None) -> dict[str, str]:
    """The node's training environment: the worker's, minus withheld names, plus launch.env, secrets and MLflow;
    and the interface of `address` (the one the node reported) for NCCL and gloo, unless either is set already."""
    from rloo_engine.pipeline.environment import child_env

    extra = {**spec.launch.get("env", {}), **secrets, "PYTHONUNBUFFERED": "1"}
    interface = interface_of(address) if address else None
    if interface and not any(name in base or name in extra for name in SOCKET_IFNAME_VARIABLES):
        extra.update(dict.fromkeys(SOCKET_IFNAME_VARIABLES, interface))
    extra["TQDM_MININTERVAL"] = base.get("TQDM_MININTERVAL", "5")
    if spec.train_run:
        extra.update(MLFLOW_TRACKING_URI=spec.train_run.tracking_uri, MLFLOW_RUN_ID=spec.train_run.run_id)
    return child_env(dict(base), set(spec.withhold_env), extra)


def wait_for_server_node(url: str, timeout_s: float, poll_s: float = 1.0) -> None:
    """Returns once the vLLM server node at `url` answers /health; raises TimeoutError naming it after `timeout_s`."""
    try:
        wait_for_health(url, timeout_s, poll_s=poll_s)
    except TimeoutError as err:
        raise TimeoutError(f"the vLLM server node at {err}") from None
