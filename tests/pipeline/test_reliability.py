"""Training outlives nobody: the engine group dies with the flow-run process, and a kill is reported as a kill."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import mlflow
import pytest

from rloo_engine.pipeline.launcher import run_in_process_group
from rloo_engine.pipeline.train_launch import EngineCrashed, engine_exit_code, raise_for_exit, record_exit
from rloo_engine.services import group_alive
from tests.engine.helpers import repo_pythonpath

REPO = Path(__file__).resolve().parents[2]

# The engine stand-in: like `accelerate launch`, a launcher whose child does the work. The child makes the
# call the engine makes at start-up, then works for two minutes.
ENGINE = ("from rloo_engine.lifetime import die_with_parent_if_asked; die_with_parent_if_asked(); "
          "print('engine ready', flush=True); import time; time.sleep(120)")
LAUNCHER = (
    "import subprocess, sys, time\n"
    f"child = subprocess.Popen([sys.executable, '-c', {ENGINE!r}])\n"
    "print('engine', child.pid, flush=True)\n"
    "child.wait()\n"
)
# The flow-run process: runs the launcher through run_in_process_group, as the train task does.
FLOW_RUN = (
    "import os, sys\n"
    "from pathlib import Path\n"
    "from rloo_engine.pipeline.launcher import run_in_process_group\n"
    "def on_line(line):\n"
    "    print(line, flush=True)\n"
    f"run_in_process_group([sys.executable, '-c', {LAUNCHER!r}], env=dict(os.environ), "
    "log_path=Path(sys.argv[1]), on_line=on_line)\n"
)


def _pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_sigkill_of_the_flow_run_process_kills_the_engine_group(tmp_path):
    env = {**os.environ, "PYTHONPATH": repo_pythonpath()}
    flow_run = subprocess.Popen([sys.executable, "-c", FLOW_RUN, str(tmp_path / "train.log")], env=env, cwd=REPO,
                                stdout=subprocess.PIPE, text=True)
    try:
        engine_pid = int(flow_run.stdout.readline().split()[1])
        group = os.getpgid(engine_pid)
        assert group != os.getpgid(flow_run.pid)  # training runs in its own process group
        while "engine ready" not in flow_run.stdout.readline():  # the engine has made its start-up call
            pass
        flow_run.send_signal(signal.SIGKILL)  # no finally, no handler runs in the flow-run process
        flow_run.wait()
        deadline = time.monotonic() + 5
        while (group_alive(group) or _pid_alive(engine_pid)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _pid_alive(engine_pid), "the engine outlived the flow-run process"
        assert not group_alive(group), "a process of the training group outlived the flow-run process"
    finally:
        if flow_run.poll() is None:
            flow_run.kill()
        try:
            os.killpg(group, signal.SIGKILL)
        except (ProcessLookupError, NameError):
            pass


def test_a_killed_engine_under_accelerate_launch_is_reported_as_sigkill(tmp_path):
    """The real `accelerate launch` exits 1 when its child is killed; the cause is read from its output."""
    script = tmp_path / "victim.py"
    script.write_text("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n")
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--cpu", "--num_processes", "1", "--num_machines", "1",
           "--mixed_precision", "no", "--dynamo_backend", "no", str(script)]
    outcome = run_in_process_group(cmd, env=dict(os.environ), log_path=tmp_path / "train.log", on_line=lambda _: None)
    assert outcome.returncode == 1  # what the task saw before: "exit code 1"
    assert engine_exit_code(outcome.returncode, outcome.tail) == -signal.SIGKILL
    with pytest.raises(EngineCrashed, match=r"killed by SIGKILL \(often the OOM killer\)"):
        raise_for_exit(outcome.returncode, outcome.tail, outcome.log_path)


def test_the_exit_cause_is_an_mlflow_tag_of_the_train_run(tmp_path):
    from rloo_engine.pipeline.tracking import RunRef

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = mlflow.MlflowClient(uri)
    exp = client.create_experiment("exit-cause", artifact_location=str(tmp_path / "artifacts"))
    ref = RunRef(tracking_uri=uri, experiment_id=exp, run_id=client.create_run(exp).info.run_id)
    record_exit(ref, 1, ["subprocess.CalledProcessError: Command '[...]' died with <Signals.SIGKILL: 9>."])
    tags = client.get_run(ref.run_id).data.tags
    assert tags["rloo.exit_cause"] == "killed by SIGKILL (often the OOM killer)"
    assert tags["rloo.exit_code"] == "-9"
    record_exit(ref, 1, ["... returned non-zero exit status 3."])
    assert client.get_run(ref.run_id).data.tags["rloo.exit_cause"] == "exit code 3"
