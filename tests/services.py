"""Processes for tests that need real services (MLflow, Prefect servers and workers): started in their own process
groups with their output in a log file, polled until they answer, and stopped group and all."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Service:
    name: str
    proc: subprocess.Popen
    log_path: Path

    def log_tail(self, n: int = 40) -> str:
        lines = self.log_path.read_text(errors="replace").splitlines() if self.log_path.exists() else []
        return "\n".join(lines[-n:])

    def stop(self, grace: float = 5.0) -> None:
        """SIGTERM the whole process group (servers spawn workers), then SIGKILL what is left."""
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                return
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline:
                self.proc.poll()
                try:
                    os.killpg(self.proc.pid, 0)
                except ProcessLookupError:
                    return
                time.sleep(0.2)


def start_service(name: str, cmd: list[str], env: dict[str, str], log_dir: Path, cwd: Path = REPO_ROOT) -> Service:
    log_path = log_dir / f"{name}.log"
    log = log_path.open("wb")
    proc = subprocess.Popen(
        cmd,
        env=env,
        cwd=cwd,
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    return Service(name, proc, log_path)


def wait_until_ready(service: Service, url: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if service.proc.poll() is not None:
            raise RuntimeError(f"{service.name} exited with {service.proc.returncode}:\n{service.log_tail()}")
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{service.name} not ready at {url} after {timeout} s:\n{service.log_tail()}")
