"""How the train stage launches the engine and reads its end: the `accelerate launch` command, and the engine's exit
code mapped to an error that says what happened (config error: not retried; crash: a retry resumes).

Exit codes (`rloo_engine/exit_codes.py`): 0 ok, 2 config error, 3 injected crash, 4 a reward source failed,
5 an output could not be written (disk); anything else a failure. accelerate's launcher exits 1 and names its
child's code in its last lines.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import yaml

from rloo_engine import exit_codes
from rloo_engine.config_base import ConfigError
from rloo_engine.pipeline import tracking
from rloo_engine.pipeline.config import LaunchSection
from rloo_engine.pipeline.profiles import resolve_profile
from rloo_engine.pipeline.tracking import RunRef

EXIT_OK, EXIT_CONFIG = exit_codes.OK, exit_codes.CONFIG_ERROR


class EngineConfigError(ConfigError):
    """The engine rejected its configuration (exit code 2); retrying cannot help."""


class EngineCrashed(RuntimeError):
    """The engine process died (injected crash, OOM kill, NCCL error, a bug); a retry resumes from a checkpoint."""


# A late node's own start after it is picked up: imports, the shared-directory check, its report.
RENDEZVOUS_MARGIN_S = 300


def rendezvous_timeout_s(launch: LaunchSection) -> int:
    """How long rank 0's rendezvous waits for the other machines: their start timeout and a margin."""
    return int(launch.nodes.start_timeout_s + RENDEZVOUS_MARGIN_S)


def launch_command(
    launch: LaunchSection,
    config_path: Path,
    *,
    machine_rank: int = 0,
    main_process_ip: str | None = None,
    main_process_port: int | None = None,
) -> list[str]:
    """`accelerate launch --config_file <profile> [overrides] -m rloo_engine train --config <file>`; with
    `launch.num_machines > 1`, the command of machine `machine_rank`, whose rank 0 is at `main_process_ip`."""
    profile = resolve_profile(launch.profile, dict(os.environ))
    cmd = [sys.executable, "-m", "accelerate.commands.accelerate_cli", "launch", "--config_file", str(profile)]
    profile_values = yaml.safe_load(profile.read_text()) or {}
    distributed_type = str(profile_values.get("distributed_type", "NO"))
    processes = launch.num_processes or 1
    if distributed_type == "NO" and (processes > 1 or launch.num_machines > 1):
        # A profile without a distributed type (the cpu one) runs ONE process whatever --num_processes says;
        # --multi_gpu makes accelerate start them all (gloo on CPU).
        cmd.append("--multi_gpu")
    if launch.num_processes is not None:
        cmd += ["--num_processes", str(launch.num_processes)]
    if launch.num_machines > 1:
        cmd += ["--num_machines", str(launch.num_machines), "--machine_rank", str(machine_rank)]
        cmd += ["--main_process_ip", main_process_ip or "127.0.0.1"]
        if distributed_type == "DEEPSPEED":
            cmd += ["--deepspeed_multinode_launcher", "standard"]  # torchrun per node, not pdsh from rank 0
    port = main_process_port or launch.main_process_port
    if not port and processes > 1 and launch.num_machines == 1 and not profile_values.get("main_process_port"):
        # accelerate's default, 29500, is probed and then bound: two runs starting together on one machine both
        # see it free and one dies with EADDRINUSE. Port 0 makes accelerate take a free port for this run.
        port = 0
    if port is not None:
        cmd += ["--main_process_port", str(port)]
    if launch.num_machines > 1:
        # Ranks 1..N-1 start after rank 0 has reported, each within start_timeout_s: rank 0's store waits as long.
        cmd += ["--rdzv_conf", f"timeout={rendezvous_timeout_s(launch)}"]
    return cmd + ["-m", "rloo_engine", "train", "--config", str(config_path)]


# How accelerate reports its child's end: CalledProcessError says "returned non-zero exit status 3" or, for a
# signal, "died with <Signals.SIGKILL: 9>"; torchrun's error summary says "exitcode  : -9".
_LAUNCHER_CHILD_EXIT = re.compile(
    r"returned non-zero exit status (-?\d+)|exitcode\s*:\s*(-?\d+)|died with <Signals\.\w+: (\d+)>"
)


def engine_exit_code(returncode: int, tail: list[str]) -> int:
    """The engine's own exit code (negative: killed by that signal); accelerate's launcher exits 1 and reports it."""
    if returncode in exit_codes.MEANINGS or returncode < 0:
        return returncode
    for line in reversed(tail):
        if m := _LAUNCHER_CHILD_EXIT.search(line):
            return -int(m.group(3)) if m.group(3) else int(m.group(1) or m.group(2))
    return returncode


def exit_cause(code: int) -> str:
    """`exit code N` (with the engine's meaning of N past 3), or `killed by SIGNAME` for a negative code, with the
    usual reason for a SIGKILL."""
    if code > exit_codes.INJECTED_CRASH and code in exit_codes.MEANINGS:
        return f"exit code {code}: {exit_codes.MEANINGS[code]}"
    if code >= 0:
        return f"exit code {code}"
    import signal

    name = signal.Signals(-code).name if -code in signal.Signals._value2member_map_ else f"signal {-code}"
    return f"killed by {name}" + (" (often the OOM killer)" if name == "SIGKILL" else "")


def record_exit(train_run: RunRef, returncode: int, tail: list[str]) -> None:
    """Tags the train run with how the engine ended (`rloo.exit_code`, `rloo.exit_cause`), so a kill shows as one."""
    code = engine_exit_code(returncode, tail)
    tracking.set_tags(train_run, {"rloo.exit_code": code, "rloo.exit_cause": exit_cause(code)})


def raise_for_exit(returncode: int, tail: list[str], log_path: Path) -> None:
    """Maps the engine's exit code to an error that says what happened and where to look."""
    code = engine_exit_code(returncode, tail)
    if code == EXIT_OK:
        return
    last = "\n".join(tail[-15:])
    if code == EXIT_CONFIG:
        errors = [ln for ln in tail if ln.startswith("error:")] or tail[-3:]
        raise EngineConfigError("the engine rejected its configuration (exit code 2):\n" + "\n".join(errors))
    if code in exit_codes.MEANINGS:  # 3, 4, 5: the engine said what failed in its `error:` line
        errors = [ln for ln in tail if ln.startswith("error:")][-1:]
        raise EngineCrashed(
            f"the engine exited with code {code}: {exit_codes.MEANINGS[code]}; see {log_path}"
            + (f"\n{errors[0]}" if errors else "")
        )
    if code < 0:
        raise EngineCrashed(f"the engine was {exit_cause(code)}; see {log_path}. Last output:\n{last}")
    raise EngineCrashed(f"the engine failed with exit code {code}; see {log_path}. Last output:\n{last}")
