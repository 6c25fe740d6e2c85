"""One run per `output_dir`: an exclusive `flock` on `output_dir/.rloo-engine.lock`, held by rank 0 for the run's life.

The kernel releases an flock when its holder dies, however it dies, so a lock file left by a killed run
never blocks the resume; the file only names the last holder (host, pid, start time) for the error a
second run gets. Other ranks do not lock: they write only into files rank 0's lock already covers.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path

from rloo_engine.config_base import ConfigError

LOCK_NAME = ".rloo-engine.lock"

_HELD: dict[Path, RunLock] = {}  # locks this process holds, so the CLI and the trainer share one


class OutputDirLocked(ConfigError):
    """Another live run holds the output directory; retrying into it cannot help."""


class RunLock:
    def __init__(self, path: Path, fh):
        self.path, self._fh = path, fh

    def release(self) -> None:
        if self._fh is not None:
            fcntl.flock(self._fh, fcntl.LOCK_UN)
            self._fh.close()
            self._fh = None
        _HELD.pop(self.path, None)


def acquire_run_lock(output_dir: str | Path) -> RunLock:
    """Locks `output_dir` (created if missing) for this process, or raises OutputDirLocked naming the holder."""
    root = Path(output_dir)
    if root.exists() and not root.is_dir():
        raise ConfigError(f"output_dir: {root} is a file; expected a directory (or a path that does not exist yet)")
    root.mkdir(parents=True, exist_ok=True)
    path = (root / LOCK_NAME).resolve()
    if path in _HELD:
        return _HELD[path]
    fh = open(path, "a+")
    try:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        fh.seek(0)
        holder = _describe(fh.read())
        fh.close()
        raise OutputDirLocked(
            f"output_dir: {root} is in use by another run ({holder}; lock file {path}); expected a directory no "
            "other run writes to: wait for that run to end, or choose another output_dir"
        ) from None
    fh.seek(0)
    fh.truncate()
    fh.write(json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                         "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}))
    fh.flush()
    lock = _HELD[path] = RunLock(path, fh)
    return lock


def _describe(text: str) -> str:
    try:
        info = json.loads(text)
        return f"host {info['host']}, pid {info['pid']}, since {info['started']}"
    except (ValueError, KeyError, TypeError):
        return "holder unknown: the lock file is being written"
