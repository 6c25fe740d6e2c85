"""The training launcher: process-group kills on every exit path, output streaming, exit-code mapping."""

from __future__ import annotations

import logging
import os
import sys
import time

import pytest

from rloo_engine.config_base import ConfigError
from rloo_engine.pipeline.launcher import LaunchTimeout, ThrottledLineLogger, run_in_process_group
from rloo_engine.pipeline.train_launch import (
    EngineConfigError,
    EngineCrashed,
    engine_exit_code,
    exit_cause,
    raise_for_exit,
)
from rloo_engine.services import group_alive

# A parent that starts a long-lived grandchild (like accelerate starting the engine), then talks and waits.
FAMILY = (
    "import subprocess, sys, time\n"
    "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
    "print('child', child.pid, flush=True)\n"
    "print('progress 1\\rprogress 2\\rprogress 3', flush=True)\n"
    "time.sleep(120)\n"
)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as fh:
        return fh.read().split()[2] != "Z"  # a zombie is dead, only not yet reaped


class Stop(BaseException):
    """Stands in for Prefect's TerminationSignal (a BaseException raised in the task's thread on cancel)."""


def test_cancellation_kills_the_whole_process_group(tmp_path):
    seen: list[str] = []

    def on_line(line: str) -> None:
        seen.append(line)
        if line.startswith("progress 3"):
            raise Stop()

    with pytest.raises(Stop):
        run_in_process_group(
            [sys.executable, "-c", FAMILY],
            env=dict(os.environ),
            log_path=tmp_path / "out.log",
            on_line=on_line,
            kill_grace_seconds=2,
        )
    child = int(seen[0].split()[1])
    assert not _pid_alive(child)
    assert not group_alive(child)  # same group as its parent; the group is gone
    assert seen[1:] == ["progress 1", "progress 2", "progress 3"]  # carriage returns split progress updates
    assert "progress 3" in (tmp_path / "out.log").read_text()


def test_timeout_kills_the_group_and_raises(tmp_path):
    lines: list[str] = []
    started = time.monotonic()
    with pytest.raises(LaunchTimeout, match="still running after 2 s"):
        run_in_process_group(
            [sys.executable, "-c", FAMILY],
            env=dict(os.environ),
            log_path=tmp_path / "out.log",
            on_line=lines.append,
            timeout_seconds=2,
            kill_grace_seconds=1,
        )
    assert time.monotonic() - started < 15
    assert not _pid_alive(int(lines[0].split()[1]))


def test_stray_grandchildren_are_killed_after_a_clean_exit(tmp_path):
    script = (
        "import subprocess, sys\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'], stdout=subprocess.DEVNULL)\n"
        "print('child', child.pid, flush=True)\n"
    )
    lines: list[str] = []
    outcome = run_in_process_group(
        [sys.executable, "-c", script],
        env=dict(os.environ),
        log_path=tmp_path / "out.log",
        on_line=lines.append,
        kill_grace_seconds=1,
    )
    assert outcome.returncode == 0
    assert not _pid_alive(int(lines[0].split()[1]))


def test_accelerate_reports_the_engine_exit_code_in_its_output():
    tail = [
        "subprocess.CalledProcessError: Command '['python', '-m', 'rloo_engine', 'train']' "
        "returned non-zero exit status 3."
    ]
    assert engine_exit_code(1, tail) == 3
    assert engine_exit_code(1, ["  exitcode  : 2 (pid: 123)"]) == 2
    assert engine_exit_code(2, []) == 2 and engine_exit_code(-9, []) == -9
    assert engine_exit_code(1, ["Traceback ...", "RuntimeError: boom"]) == 1


def test_exit_codes_map_to_clear_errors(tmp_path):
    log = tmp_path / "train.log"
    raise_for_exit(0, [], log)
    with pytest.raises(
        EngineConfigError, match="rejected its configuration \\(exit code 2\\):\nerror: dataset_name: x"
    ):
        raise_for_exit(2, ["noise", "error: dataset_name: x does not exist"], log)
    assert issubclass(EngineConfigError, ConfigError)  # config errors are never retried
    with pytest.raises(EngineCrashed, match="injected crash"):
        raise_for_exit(1, ["... returned non-zero exit status 3."], log)
    with pytest.raises(EngineCrashed, match=r"killed by SIGKILL \(often the OOM killer\)"):
        raise_for_exit(-9, [], log)
    with pytest.raises(EngineCrashed, match="failed with exit code 1; see .*train.log"):
        raise_for_exit(1, ["RuntimeError: CUDA error"], log)
    # A failing reward source and a full disk: told apart by their codes, the engine's error line quoted.
    reward_tail = ["error: reward_funcs my.rewards:judge raised ConnectionError: down", "... returned non-zero exit status 4."]
    with pytest.raises(EngineCrashed, match=r"code 4: a reward source failed during training; see .*\n"
                                            r"error: reward_funcs my.rewards:judge raised ConnectionError"):
        raise_for_exit(1, reward_tail, log)
    with pytest.raises(EngineCrashed, match=r"code 5: an output could not be written \(disk full"):
        raise_for_exit(5, ["error: checkpoint-8: out has 1024 bytes free"], log)
    assert exit_cause(4) == "exit code 4: a reward source failed during training"
    assert exit_cause(5).startswith("exit code 5: an output could not be written")
    assert exit_cause(3) == "exit code 3"


def test_output_is_throttled_but_errors_always_pass(caplog):
    logger = logging.getLogger("throttle-test")
    forward = ThrottledLineLogger(logger, interval=60)
    with caplog.at_level(logging.INFO, logger="throttle-test"):
        for i in range(50):
            forward(f"rloo: {i}/50 steps")
        forward("RuntimeError: CUDA out of memory")
        forward("rloo-engine: resumed from out/checkpoint-4 at step 4")
    messages = [r.getMessage() for r in caplog.records]
    assert messages == [
        "rloo: 0/50 steps",
        "RuntimeError: CUDA out of memory",
        "rloo-engine: resumed from out/checkpoint-4 at step 4",
    ]
    assert caplog.records[1].levelno == logging.WARNING


def test_retry_condition_skips_config_errors():
    from prefect.states import Failed

    from tasks.train import _retry_unless_config_error

    assert not _retry_unless_config_error(None, None, Failed(data=EngineConfigError("bad option")))
    assert _retry_unless_config_error(None, None, Failed(data=EngineCrashed("exit code 3")))
