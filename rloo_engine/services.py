"""A local HTTP service's life, one way for every caller (the pipeline's vLLM server and nodes, the test and bench
servers): a free port, the wait for `/health`, and the end of its process group; and `scoped_env`, environment
variables set for a block and restored after (a judge's key, the variables a vLLM engine is built under)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def scoped_env(values: dict[str, str], restore: Iterable[str] = ()) -> Iterator[None]:
    """Sets environment variables for the duration of the block, then restores what was there: those in `values`,
    and those named in `restore` (what code run inside the block may set itself)."""
    saved = {k: os.environ.get(k) for k in [*values, *restore]}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, old in saved.items():
            if old is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = old


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on `host` now (0.0.0.0: on every interface)."""
    with socket.socket() as s:
        s.bind((host if host != "0.0.0.0" else "", 0))
        return s.getsockname()[1]


class ServiceExited(RuntimeError):
    """The service's process ended before it answered /health."""


def wait_for_health(url: str, timeout_s: float, running: Callable[[], bool] = lambda: True,
                    poll_s: float = 0.5) -> None:
    """Returns once `<url>/health` answers 200. Raises ServiceExited as soon as `running()` is false, and
    TimeoutError (with the last answer) after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while time.monotonic() < deadline:
        if not running():
            raise ServiceExited(f"{url} exited before answering /health")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as reply:
                if reply.status == 200:
                    return
                last = f"HTTP {reply.status}"
        except (OSError, urllib.error.URLError) as err:
            last = str(err)
        time.sleep(poll_s)
    raise TimeoutError(f"{url} was not healthy after {timeout_s:.0f} s ({last})")


def group_alive(pgid: int) -> bool:
    """Whether a process of group `pgid` still runs. Zombies do not count: a dead engine core whose parent has not
    reaped it yet holds nothing. Without /proc, `killpg(pgid, 0)` (which counts them)."""
    proc = Path("/proc")
    if not proc.is_dir():
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    for stat in proc.glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # state, ppid, pgrp, ...
        except (OSError, IndexError):
            continue  # exited while we looked
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def kill_process_group(pgid: int, grace_seconds: float, leader: subprocess.Popen | None = None) -> None:
    """SIGTERM every process of the group, wait up to `grace_seconds`, then SIGKILL what is left; returns once
    none runs (or 10 s after the SIGKILL). The leader is reaped while waiting."""
    for sig, wait in ((signal.SIGTERM, grace_seconds), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if not group_alive(pgid):
                _reap(leader)
                return
            time.sleep(0.1)
    _reap(leader)


def _reap(leader: subprocess.Popen | None) -> None:
    # a leader that died between two looks is a zombie, not yet reaped: polling before the look would miss it
    if leader is not None:
        try:
            leader.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            pass
