"""The work-pool recipes in deployments/ (Kubernetes, Slurm, systemd) give every node run what multi-node needs.

No cluster here, so each recipe is checked as far as this machine can: the Kubernetes base job template is rendered
with Prefect's own templating, stored by a real Prefect server, and turned into the Job the Kubernetes worker would
submit (by the worker's own job configuration, when prefect-kubernetes is installed); the sbatch script runs against
a stand-in `srun`; the systemd unit is read and checked by `systemd-analyze verify`.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import textwrap
import uuid
from pathlib import Path

import pytest
from prefect.utilities.templating import apply_values, find_placeholders

from rloo_engine.pipeline.multinode import NODE_ADDRESS_ENV, NODE_ROOT_ENV, node_address
from tests.pipeline.conftest import BIN
from tests.pipeline.pipeline_helpers import REPO_ROOT

K8S_TEMPLATE = REPO_ROOT / "deployments" / "kubernetes" / "train-nodes.base-job-template.json"
SBATCH = REPO_ROOT / "deployments" / "slurm" / "train-nodes.sbatch"
UNIT = REPO_ROOT / "deployments" / "process" / "prefect-train-node.service"
IMAGE = "registry.example.com/rloo-pipeline:test"


def k8s_template() -> dict:
    return json.loads(K8S_TEMPLATE.read_text())


def render(overrides: dict) -> dict:
    """The job configuration as a worker fills it: the variables' defaults (None ones dropped, as Prefect's workers
    do, so their keys vanish from the manifest) under `overrides`."""
    template = k8s_template()
    properties = template["variables"]["properties"]
    values = {name: p["default"] for name, p in properties.items() if p.get("default") is not None}
    return apply_values(template["job_configuration"], {**values, **overrides})


def pod_spec(job_manifest: dict) -> dict:
    return job_manifest["spec"]["template"]["spec"]


def env_entry(container: dict, name: str) -> dict:
    entries = [e for e in container["env"] if e["name"] == name]
    assert len(entries) == 1, f"{name} appears {len(entries)} times in the container's env: {container['env']}"
    return entries[0]


def kubernetes_worker():
    try:
        from prefect_kubernetes.worker import KubernetesWorker, KubernetesWorkerJobConfiguration
    except ImportError:
        pytest.skip("prefect-kubernetes is not installed (pip install -e '.[kubernetes]'); the dev extra has it)")
    return KubernetesWorker, KubernetesWorkerJobConfiguration


# ---------------------------------------------------------------- Kubernetes: the template itself


def test_k8s_template_renders_a_job_with_gpus_shared_volume_pod_address_and_no_restarts():
    template = k8s_template()
    assert set(template) == {"job_configuration", "variables"}
    overrides = {"image": IMAGE, "gpus_per_node": 4, "output_mount": "/mnt/rloo", "shm_size": "32Gi",
                 "node_selector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}}
    job = render(overrides)["job_manifest"]
    spec = pod_spec(job)
    [container] = spec["containers"]

    assert container["image"] == IMAGE
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 4
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert volumes[mounts["/mnt/rloo"]]["persistentVolumeClaim"] == {"claimName": "rloo-outputs"}
    assert env_entry(container, NODE_ROOT_ENV) == {"name": NODE_ROOT_ENV, "value": "/mnt/rloo"}
    assert env_entry(container, NODE_ADDRESS_ENV)["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert env_entry(container, "RLOO_ACCELERATE_PROFILE")["value"] == "multi_gpu"
    assert volumes[mounts["/dev/shm"]]["emptyDir"] == {"medium": "Memory", "sizeLimit": "32Gi"}
    assert spec["nodeSelector"] == overrides["node_selector"]
    assert spec["restartPolicy"] == "Never"
    assert job["spec"]["backoffLimit"] == 0
    assert "tolerations" not in spec  # no default: the key is left out, not sent empty

    defaults = render({"image": IMAGE})["job_manifest"]
    [container] = pod_spec(defaults)["containers"]
    assert container["resources"]["limits"] == {"nvidia.com/gpu": 8}  # the unset CPU/memory limits are dropped
    assert {m["mountPath"] for m in container["volumeMounts"]} == {"/outputs", "/dev/shm"}
    assert env_entry(container, NODE_ROOT_ENV)["value"] == "/outputs"
    shm = next(v for v in pod_spec(defaults)["volumes"] if v["name"] == "dshm")
    assert shm["emptyDir"] == {"medium": "Memory"}  # no sizeLimit unless one is given


def test_k8s_template_allows_no_kubernetes_retries_and_requires_an_image():
    variables = k8s_template()["variables"]
    backoff = variables["properties"]["backoff_limit"]
    assert backoff["default"] == 0 and backoff["maximum"] == 0
    assert variables["required"] == ["image"]
    assert variables["properties"]["env"]["default"] == {"PREFECT_FLOW_RUN_EXECUTE_SIGTERM_BEHAVIOR": "crash"}


def test_k8s_template_keeps_every_placeholder_of_the_default_kubernetes_template():
    KubernetesWorker, _ = kubernetes_worker()
    default = KubernetesWorker.get_default_base_job_template()
    ours = k8s_template()

    def placeholders(job_configuration: dict) -> set[str]:
        return {p.name for p in find_placeholders(json.dumps(job_configuration))}

    missing = placeholders(default["job_configuration"]) - placeholders(ours["job_configuration"])
    assert not missing, f"the default KubernetesWorker template has placeholders this one lacks: {sorted(missing)}"
    undeclared = set(default["variables"]["properties"]) - set(ours["variables"]["properties"])
    assert not undeclared, f"variables of the default template missing here: {sorted(undeclared)}"


# ---------------------------------------------------------------- Kubernetes: a real Prefect server


@pytest.fixture(scope="module")
def k8s_pool(services) -> dict:
    """Pool `train-nodes-k8s` created from the template file by `prefect work-pool create`; what the server stored."""
    services.cli("work-pool", "create", "train-nodes-k8s", "--type", "kubernetes", "--base-job-template",
                 str(K8S_TEMPLATE))
    stored = json.loads(services.cli("work-pool", "inspect", "train-nodes-k8s", "--output", "json").stdout)
    assert stored["type"] == "kubernetes"
    return stored


@pytest.mark.slow
def test_prefect_server_stores_the_k8s_template_as_written(k8s_pool):
    """The server accepts the template for a `kubernetes` pool and stores it unchanged. It needs no prefect-kubernetes
    for that: the CLI learns the type from the server's worker metadata (its bundled copy when the collection
    registry cannot be reached, as here), and the server checks the template's placeholders against its variables."""
    assert k8s_pool["base_job_template"] == k8s_template()


def node_deployment(services, job_variables: dict) -> str:
    """A `train-node/node` deployment on the Kubernetes pool, as `prefect deploy` would make it; returns its id."""
    from prefect.client.orchestration import get_client

    async def create() -> str:
        async with get_client() as client:
            flow_id = await client.create_flow_from_name("train-node")
            deployment_id = await client.create_deployment(
                flow_id=flow_id,
                name=f"node-{uuid.uuid4().hex[:8]}",
                work_pool_name="train-nodes-k8s",
                entrypoint="flows/train_node.py:train_node",
                job_variables=job_variables,
            )
            return str(deployment_id)

    with services.prefect_settings():
        return asyncio.run(create())


def start_node_run(services, deployment_id: str, job_variables: dict):
    """A flow run of the deployment with the train task's per-run job variables (launch.nodes.job_variables)."""
    from prefect.client.orchestration import get_client

    async def create():
        async with get_client() as client:
            return await client.create_flow_run_from_deployment(deployment_id, job_variables=job_variables)

    with services.prefect_settings():
        return asyncio.run(create())


DEPLOYMENT_ENV = {"MLFLOW_TRACKING_URI": "http://mlflow.internal:5000", "RLOO_ACCELERATE_PROFILE": "deepspeed_zero3"}


@pytest.mark.slow
def test_a_node_run_without_an_image_or_with_kubernetes_retries_is_refused(services, k8s_pool):
    """Prefect's own image cannot train and a Kubernetes retry of one node cannot rejoin the others: the server
    refuses such a node run when the train task creates it, before any pod is scheduled."""
    from prefect.exceptions import PrefectHTTPStatusError

    no_image = node_deployment(services, {"env": DEPLOYMENT_ENV})
    with pytest.raises(PrefectHTTPStatusError) as refused:
        start_node_run(services, no_image, {})
    assert refused.value.response.status_code == 422 and "image" in refused.value.response.text

    with_image = node_deployment(services, {"image": IMAGE, "env": DEPLOYMENT_ENV})
    with pytest.raises(PrefectHTTPStatusError) as refused:
        start_node_run(services, with_image, {"backoff_limit": 2})
    assert refused.value.response.status_code == 422 and "backoff_limit" in refused.value.response.text
    assert start_node_run(services, with_image, {"gpus_per_node": 4}).id


@pytest.mark.slow
def test_kubernetes_worker_builds_the_node_job_from_the_stored_pool(services, k8s_pool):
    """The Job manifest the Kubernetes worker would submit for a node run, built by the worker's own job
    configuration from the stored pool, the deployment's job variables and the run's (as the worker does)."""
    _, KubernetesWorkerJobConfiguration = kubernetes_worker()
    from prefect.client.orchestration import get_client

    deployment_id = node_deployment(services, {"image": IMAGE, "env": DEPLOYMENT_ENV})
    flow_run = start_node_run(services, deployment_id, {"gpus_per_node": 4, "env": {"NCCL_DEBUG": "INFO"}})

    async def build() -> dict:
        async with get_client() as client:
            pool = await client.read_work_pool("train-nodes-k8s")
            config = await KubernetesWorkerJobConfiguration.resolve_for_flow_run(
                flow_run, client=client, work_pool=pool, worker_name="k8s-worker"
            )
            return config.job_manifest

    with services.prefect_settings():
        job = asyncio.run(build())
    spec = pod_spec(job)
    [container] = spec["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert container["image"] == IMAGE
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 4
    assert env_entry(container, NODE_ADDRESS_ENV)["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert env[NODE_ROOT_ENV] == "/outputs"
    assert env["RLOO_ACCELERATE_PROFILE"] == "deepspeed_zero3"  # the deployment's env wins over the pool variable
    env_entry(container, "RLOO_ACCELERATE_PROFILE")  # and appears once
    assert env["MLFLOW_TRACKING_URI"] == DEPLOYMENT_ENV["MLFLOW_TRACKING_URI"] and env["NCCL_DEBUG"] == "INFO"
    assert env["PREFECT__FLOW_RUN_ID"] == str(flow_run.id)
    # An evicted node's run is Crashed (the train task then stops and retries every node), never rescheduled alone.
    assert env["PREFECT_FLOW_RUN_EXECUTE_SIGTERM_BEHAVIOR"] == "crash"
    assert job["spec"]["backoffLimit"] == 0 and spec["restartPolicy"] == "Never"
    # The label deployments/kubernetes/README.md's NetworkPolicy selects the node pods by.
    assert job["spec"]["template"]["metadata"]["labels"]["rloo-pipeline/role"] == "train-node"


# ---------------------------------------------------------------- Slurm


def sbatch_commands() -> str:
    """The script without comments and with continued lines joined."""
    lines = [line for line in SBATCH.read_text().splitlines() if not line.lstrip().startswith("#")]
    return "\n".join(lines).replace("\\\n", " ")


def test_sbatch_script_parses_and_starts_one_limited_worker_per_node_with_one_srun():
    subprocess.run(["bash", "-n", str(SBATCH)], check=True)
    directives = dict(re.findall(r"^#SBATCH --([\w-]+)(?:=(\S+))?", SBATCH.read_text(), re.M))
    assert {"nodes", "gpus-per-node", "time", "exclusive", "ntasks-per-node"} <= set(directives)
    body = sbatch_commands()
    sruns = re.findall(r"\bsrun\b.*", body)
    assert len(sruns) == 1, sruns
    assert "--ntasks-per-node=1" in sruns[0]
    worker = re.search(r'prefect"? worker start (.*)', body).group(1)
    assert "--pool train-nodes" in worker and "--type process" in worker and "--limit 1" in worker
    assert '--name "train-node-$SLURMD_NODENAME"' in worker


def stub(path: Path, body: str) -> None:
    path.write_text("#!/usr/bin/env bash\n" + textwrap.dedent(body))
    path.chmod(0o755)


@pytest.fixture
def fake_cluster(tmp_path) -> dict:
    """`srun` that runs its command once per node (SLURMD_NODENAME gpu-1, gpu-2, ...), `hostname -I` and `ip` that
    report per-node addresses, and a checkout whose `prefect` records how it was started."""
    bin_dir, checkout, seen = tmp_path / "bin", tmp_path / "checkout", tmp_path / "seen"
    for d in (bin_dir, checkout / ".venv" / "bin", seen):
        d.mkdir(parents=True)
    stub(bin_dir / "srun", f"""
        echo "$*" > {seen}/srun.args
        while [[ "$1" == -* ]]; do shift; done
        pids=()
        for i in $(seq 1 "$SLURM_JOB_NUM_NODES"); do SLURMD_NODENAME="gpu-$i" "$@" & pids+=($!); done
        rc=0
        for pid in "${{pids[@]}}"; do wait "$pid" || rc=$?; done
        exit $rc
    """)
    stub(bin_dir / "hostname", 'echo "10.0.0.${SLURMD_NODENAME#gpu-} 172.17.0.1"\n')
    stub(bin_dir / "ip", """
        [ "$6" = ib0 ] || { echo "Device \\"$6\\" does not exist." >&2; exit 1; }
        echo "4: ib0    inet 10.10.0.${SLURMD_NODENAME#gpu-}/16 brd 10.10.255.255 scope global ib0"
    """)
    stub(checkout / ".venv" / "bin" / "prefect",
         f'echo "$PWD|$RLOO_NODE_ADDRESS|$MLFLOW_TRACKING_URI|${{NCCL_SOCKET_IFNAME:-}}|${{GLOO_SOCKET_IFNAME:-}}|$*" '
         f'> {seen}/"$SLURMD_NODENAME"\n')
    env = {
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "SLURM_JOB_NUM_NODES": "2",
        "SLURM_CPUS_ON_NODE": "96",
        "RLOO_PIPELINE_DIR": str(checkout),
        "PREFECT_API_URL": "http://prefect.internal:4200/api",
        "MLFLOW_TRACKING_URI": "http://mlflow.internal:5000",
    }
    return {"env": env, "checkout": checkout, "seen": seen}


def run_sbatch(env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SBATCH)], env=env, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("iface, addresses", [(None, ["10.0.0.1", "10.0.0.2"]), ("ib0", ["10.10.0.1", "10.10.0.2"])])
def test_sbatch_script_starts_a_named_worker_with_its_own_address_on_each_node(fake_cluster, iface, addresses):
    env = {**fake_cluster["env"], **({"RLOO_NODE_IFACE": iface} if iface else {})}
    proc = run_sbatch(env)
    assert proc.returncode == 0, proc.stderr
    seen = fake_cluster["seen"]
    srun_args = (seen / "srun.args").read_text()
    assert "--nodes=2 --ntasks-per-node=1 --cpus-per-task=96" in srun_args
    for node, address in zip(["gpu-1", "gpu-2"], addresses):
        cwd, node_address_seen, mlflow, nccl_if, gloo_if, args = (seen / node).read_text().strip().split("|")
        assert cwd == str(fake_cluster["checkout"])
        assert node_address_seen == address
        assert nccl_if == gloo_if == (iface or "")  # the collectives train over the interface the node reports
        assert mlflow == env["MLFLOW_TRACKING_URI"]
        assert args == f"worker start --pool train-nodes --type process --limit 1 --name train-node-{node}"


def test_sbatch_script_fails_at_once_on_a_missing_setting_or_interface(fake_cluster):
    env = {k: v for k, v in fake_cluster["env"].items() if k != "RLOO_PIPELINE_DIR"}
    proc = run_sbatch(env)
    assert proc.returncode != 0 and "RLOO_PIPELINE_DIR" in proc.stderr
    assert not (fake_cluster["seen"] / "srun.args").exists()

    proc = run_sbatch({**fake_cluster["env"], "RLOO_NODE_IFACE": "eth9"})
    assert proc.returncode != 0 and "RLOO_NODE_IFACE=eth9 has no IPv4 address" in proc.stderr
    assert not list(fake_cluster["seen"].glob("gpu-*"))


# ---------------------------------------------------------------- systemd


def unit_entries() -> list[tuple[str, str, str]]:
    """(section, key, value) of every assignment in the unit, in order (systemd allows repeated keys)."""
    entries, section = [], ""
    for line in UNIT.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        key, _, value = line.partition("=")
        entries.append((section, key, value))
    return entries


def test_systemd_unit_runs_one_limited_worker_and_takes_its_runs_down_with_it():
    service = {}
    environment = {}
    for section, key, value in unit_entries():
        if section == "Service" and key == "Environment":
            name, _, val = value.partition("=")
            environment[name] = val
        elif section == "Service":
            service[key] = value
    exec_start = service["ExecStart"].split()
    assert exec_start[1:4] == ["worker", "start", "--pool"] and exec_start[4] == "train-nodes"
    assert " --type process --limit 1 " in f" {service['ExecStart']} "
    assert exec_start[0] == f"{service['WorkingDirectory']}/.venv/bin/prefect"
    assert service["KillMode"] == "control-group"
    assert service["Restart"] == "on-failure"
    assert {"PREFECT_API_URL", "MLFLOW_TRACKING_URI", "RLOO_PIPELINE_DIR", NODE_ADDRESS_ENV} <= set(environment)
    assert environment["RLOO_PIPELINE_DIR"] == service["WorkingDirectory"]
    # Left empty, RLOO_NODE_ADDRESS means "the address of the route toward the Prefect API".
    assert environment[NODE_ADDRESS_ENV] == ""
    assert node_address({NODE_ADDRESS_ENV: ""}, "http://127.0.0.1:4200/api") == "127.0.0.1"


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_systemd_unit_passes_systemd_analyze_verify(tmp_path):
    """systemd's own parser finds no unknown key or bad value (the checkout's paths are pointed at this machine's,
    since verify also checks that ExecStart exists)."""
    text = UNIT.read_text()
    workdir = re.search(r"^WorkingDirectory=(.*)$", text, re.M).group(1)
    text = text.replace(f"{workdir}/.venv/bin/prefect", str(BIN / "prefect")).replace(workdir, str(tmp_path))
    unit = tmp_path / UNIT.name
    unit.write_text(text)
    proc = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and not proc.stderr.strip(), proc.stderr
