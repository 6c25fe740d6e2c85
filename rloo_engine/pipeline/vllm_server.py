"""The vLLM server beside the training group (`launch.vllm_server`): its command, devices, start, health wait, stop.

`rloo-engine vllm-serve` runs in its own session and process group, like the training group
(`launcher.py`), with `PR_SET_PDEATHSIG` so it dies with the flow-run process even when that is SIGKILLed
(the flag survives the `exec` into vLLM's server, and vLLM's engine core exits with its API server).
`running_vllm_server` is a context manager: whatever ends the block (success, an engine failure, a timeout,
Prefect's cancellation), the whole group gets SIGTERM, then SIGKILL after the grace period.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from rloo_engine.config_base import ConfigError
from rloo_engine.lifetime import die_with_parent
from rloo_engine.pipeline.config import VLLMServerSection
from rloo_engine.services import ServiceExited, free_port, group_alive, kill_process_group, wait_for_health

# vLLM's argument parser (and vllm-serve's own refusal) exit 2: a usage error, which a retry cannot fix.
USAGE_ERROR_EXIT = 2


class VLLMServerConfigError(ConfigError):
    """The server rejected its arguments (exit code 2); retrying cannot help."""


class VLLMServerFailed(RuntimeError):
    """The server died or stayed unhealthy at start; a retry starts a fresh one."""


@dataclass
class RunningServer:
    url: str
    pid: int
    log_path: Path


def pick_port(host: str, port: int | None) -> int:
    """`port`, or a free port on `host` when it is None or 0."""
    return port or free_port(host)


def split_devices(server: list[str] | None, visible: list[str]) -> tuple[str | None, str | None]:
    """(the server's CUDA_VISIBLE_DEVICES, the training group's), or (None, None) when there is nothing to split.

    `visible` are the node's devices as the worker sees them: its CUDA_VISIBLE_DEVICES entries, or "0".."n-1".
    """
    if server is None:
        return None, None
    if not visible:
        raise ConfigError(
            f"launch.vllm_server.devices: {server}, but this node has no CUDA device; leave devices unset on CPU"
        )
    unknown = [d for d in server if d not in visible]
    if unknown:
        raise ConfigError(
            f"launch.vllm_server.devices: {unknown} are not among this node's CUDA devices {visible}; expected "
            "entries of CUDA_VISIBLE_DEVICES (or 0..n-1 when it is unset)"
        )
    training = [d for d in visible if d not in server]
    if not training:
        raise ConfigError(
            f"launch.vllm_server.devices: {server} takes every CUDA device of this node {visible}; leave at least "
            "one for training"
        )
    return ",".join(server), ",".join(training)


def visible_cuda_devices(env: dict[str, str]) -> list[str]:
    """The node's CUDA devices as the worker sees them (torch is imported only when CUDA_VISIBLE_DEVICES is unset)."""
    if "CUDA_VISIBLE_DEVICES" in env:
        return [d.strip() for d in env["CUDA_VISIBLE_DEVICES"].split(",") if d.strip()]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())]


def serve_command(settings: VLLMServerSection, model_path: str, port: int, dtype: str, seed: int) -> list[str]:
    """`python -m rloo_engine vllm-serve --model ... [--] extra_args`."""
    tp = settings.tensor_parallel_size or (len(settings.devices) if settings.devices else 1)
    cmd = [sys.executable, "-m", "rloo_engine", "vllm-serve", "--model", model_path, "--host", settings.host,
           "--port", str(port), "--tensor_parallel_size", str(tp), "--dtype", settings.dtype or dtype,
           "--seed", str(seed)]
    if settings.gpu_memory_utilization is not None:
        cmd += ["--gpu_memory_utilization", str(settings.gpu_memory_utilization)]
    if settings.max_model_len is not None:
        cmd += ["--max_model_len", str(settings.max_model_len)]
    if settings.devices is None:  # no split: the server's GPU is a training GPU too, where NCCL cannot sync
        cmd += ["--shares_trainer_gpu"]
    return cmd + (["--", *settings.extra_args] if settings.extra_args else [])


def log_tail(log_path: Path, lines: int = 20) -> str:
    text = log_path.read_text(errors="replace") if log_path.exists() else ""
    return "\n".join(text.splitlines()[-lines:])


@contextmanager
def running_vllm_server(
    cmd: list[str],
    *,
    url: str,
    env: dict[str, str],
    log_path: Path,
    startup_timeout_s: float,
    kill_grace_seconds: float,
) -> Iterator[RunningServer]:
    """Starts the server, yields once `<url>/health` answers 200, and kills its process group on exit."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") as log:
        log.write(f"$ {' '.join(cmd)}\n".encode())
        log.flush()
        proc = subprocess.Popen(
            cmd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=functools.partial(die_with_parent, os.getpid()),
        )
    try:
        _wait_healthy(proc, url, log_path, startup_timeout_s)
        yield RunningServer(url, proc.pid, log_path)
    finally:
        kill_process_group(proc.pid, kill_grace_seconds, leader=proc)
        if group_alive(proc.pid):
            raise VLLMServerFailed(f"launch.vllm_server: the vLLM server at {url} (pgid {proc.pid}) survived SIGKILL")


def _wait_healthy(proc: subprocess.Popen, url: str, log_path: Path, timeout: float) -> None:
    try:
        wait_for_health(url, timeout, running=lambda: proc.poll() is None)
    except ServiceExited:
        error = VLLMServerConfigError if proc.returncode == USAGE_ERROR_EXIT else VLLMServerFailed
        raise error(
            f"launch.vllm_server: the vLLM server at {url} exited with code {proc.returncode} before answering "
            f"/health; its log is {log_path} (the train run's logs/{log_path.name}). Last lines:\n"
            + log_tail(log_path)
        ) from None
    except TimeoutError:
        raise VLLMServerFailed(
            f"launch.vllm_server: the vLLM server at {url} did not answer /health within startup_timeout_s="
            f"{timeout:g} s; its log is {log_path} (the train run's logs/{log_path.name}). Last lines:\n"
            + log_tail(log_path)
        ) from None
