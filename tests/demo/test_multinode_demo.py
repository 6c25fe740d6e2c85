"""`scripts/multinode_demo.sh`'s program: a Prefect server, a controller and two node workers on loopback, one
`rlhf-pipeline/on-demand` run across both nodes, everything stopped at the end."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

REPO = Path(__file__).resolve().parents[2]


def processes_mentioning(text: str) -> list[int]:
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and text in (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode():
                found.append(int(proc.name))
        except OSError:
            pass
    return found


@pytest.mark.slow
def test_multinode_demo_trains_on_two_node_workers_and_stops_everything(tmp_path):
    home = tmp_path / "multinode"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "PREFECT_"))}
    env["MULTINODE_DEMO_DIR"] = str(home)
    proc = subprocess.run([sys.executable, "scripts/multinode_demo.py"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert ": Completed" in out and "world_size 2, num_machines 2" in out, out
    assert "stopped everything this demo started" in out
    assert not processes_mentioning(str(home)), "a process of the demo outlived it"

    client = MlflowClient(f"sqlite:///{home / 'mlflow.db'}")
    exp = client.get_experiment_by_name("rloo-multinode-demo")
    train = client.search_runs([exp.experiment_id], filter_string="tags.`rloo.stage` = 'train'")
    assert len(train) == 1
    assert train[0].data.params["num_machines"] == "2" and train[0].data.params["world_size"] == "2"
    assert {(home / name).is_dir() for name in ("node-a", "node-b", "controller")} == {True}
