"""Runs a command in its own session and process group, streams its output, and always kills the whole group.

`accelerate launch` starts one or more training processes as its children; killing only the launcher
would leave them holding GPUs. The command therefore runs with `start_new_session=True`, and every
exit path (success, failure, timeout, a SIGTERM from the Prefect worker on cancellation) ends in
`kill_process_group`, inside a `finally`, so it does not depend on hooks being run.

A SIGKILLed caller runs no `finally`. For that case the child asks the kernel to SIGKILL it when its
parent dies (`PR_SET_PDEATHSIG`, Linux), and RLOO_DIE_WITH_PARENT=1 in its environment makes each
engine rank ask the same of its own parent (the `accelerate` launcher), so the group dies with us.
"""

from __future__ import annotations

import functools
import os
import re
import selectors
import subprocess
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rloo_engine.lifetime import DIE_WITH_PARENT_ENV, die_with_parent
from rloo_engine.services import kill_process_group

_LINE_SPLIT = re.compile(rb"\r\n|\r|\n")


class LaunchTimeout(TimeoutError):
    """The command ran past its time limit and was killed."""


class LaunchStopped(RuntimeError):
    """`stop_when` gave a reason to stop (e.g. the run that started this one has ended); the group was killed."""


@dataclass
class ProcessOutcome:
    returncode: int
    tail: list[str]  # last lines of combined stdout/stderr
    log_path: Path
    seconds: float


def run_in_process_group(
    cmd: list[str],
    *,
    env: dict[str, str],
    log_path: Path,
    on_line: Callable[[str], None],
    cwd: str | Path | None = None,
    timeout_seconds: float | None = None,
    kill_grace_seconds: float = 10.0,
    tail_lines: int = 60,
    stop_when: Callable[[], str | None] | None = None,
    stop_check_seconds: float = 5.0,
) -> ProcessOutcome:
    """Runs `cmd` to completion; every output line goes to `log_path` and to `on_line`.

    Raises LaunchTimeout after `timeout_seconds`, and LaunchStopped when `stop_when()` (called every
    `stop_check_seconds`) returns a reason. Whatever happens (including a BaseException such
    as Prefect's TerminationSignal raised in this thread), the process group is gone on return.
    """
    log_path.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    tail: deque[str] = deque(maxlen=tail_lines)
    with log_path.open("ab") as log:
        log.write(f"$ {' '.join(cmd)}\n".encode())
        log.flush()
        proc = subprocess.Popen(
            cmd,
            env={**env, DIE_WITH_PARENT_ENV: "1"},
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=functools.partial(die_with_parent, os.getpid()),
            bufsize=0,
        )
        pgid = proc.pid  # a new session's leader heads a process group of the same id
        try:
            _pump(proc, log, tail, on_line, started, timeout_seconds, stop_when, stop_check_seconds)
            proc.wait()
        finally:
            # Also after a clean exit: stray grandchildren (data loaders, compile workers) must not outlive us.
            kill_process_group(pgid, kill_grace_seconds, leader=proc)
            if proc.stdout is not None:
                proc.stdout.close()
    return ProcessOutcome(proc.returncode, list(tail), log_path, time.monotonic() - started)


def _pump(
    proc, log, tail: deque[str], on_line, started: float, timeout_seconds: float | None, stop_when, stop_every: float
) -> None:
    """Copies output until EOF; a short select timeout keeps the time limit checked while the child is silent."""
    assert proc.stdout is not None
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    pending = b""
    exited_at: float | None = None
    checked_at = time.monotonic()
    try:
        while True:
            if timeout_seconds is not None and time.monotonic() - started > timeout_seconds:
                raise LaunchTimeout(f"still running after {timeout_seconds:.0f} s")
            if stop_when is not None and time.monotonic() - checked_at > stop_every:
                checked_at = time.monotonic()
                if reason := stop_when():
                    raise LaunchStopped(reason)
            if not sel.select(timeout=0.5):
                # A grandchild that inherited stdout can hold the pipe open after the command exited.
                if proc.poll() is not None:
                    exited_at = exited_at or time.monotonic()
                    if time.monotonic() - exited_at > 2.0:
                        break
                continue
            chunk = os.read(proc.stdout.fileno(), 65536)
            if not chunk:
                break
            log.write(chunk)
            log.flush()
            *lines, pending = _LINE_SPLIT.split(pending + chunk)
            for raw in lines:
                _emit(raw, tail, on_line)
        if pending:
            _emit(pending, tail, on_line)
    finally:
        sel.close()


def _emit(raw: bytes, tail: deque[str], on_line) -> None:
    line = raw.decode("utf-8", errors="replace").rstrip()
    if line:
        tail.append(line)
        on_line(line)


class ThrottledLineLogger:
    """Forwards process output to a logger without flooding it.

    Lines that matter (errors, tracebacks, the engine's own notices) pass at once; other lines (progress
    bars, samples) pass at most once per `interval` seconds, with a count of what was skipped.
    """

    IMPORTANT = re.compile(r"traceback|error|exception|rloo-engine:|killed|resum", re.IGNORECASE)

    def __init__(self, logger, interval: float, max_chars: int = 500):
        self.logger, self.interval, self.max_chars = logger, interval, max_chars
        self.last_emit = float("-inf")
        self.skipped = 0

    def __call__(self, line: str) -> None:
        text = line if len(line) <= self.max_chars else line[: self.max_chars] + " ..."
        now = time.monotonic()
        if self.IMPORTANT.search(line):
            self.logger.warning(text) if "error" in line.lower() or "traceback" in line.lower() else self.logger.info(
                text
            )
        elif now - self.last_emit >= self.interval:
            suffix = f"  ({self.skipped} lines since the last one; see train.log)" if self.skipped else ""
            self.logger.info(text + suffix)
            self.last_emit, self.skipped = now, 0
        else:
            self.skipped += 1
