"""Whether a live process is making a Batch API submission right now: one flock per submission token,
in a file beside the judgment cache.

A `submitting` record in the cache's batches table means either that a run is uploading the file and
creating the batch at this moment, or that a run died in between. The first must be waited for (its
batch is about to exist), the second looked up by its token. The submitter holds an exclusive lock on
`<cache>.<token>.lock` from before it writes the record until it has recorded the batch id. The
kernel drops a dead process's locks, so a held lock means a live submitter, however long its upload
takes. flock works between the processes of one machine, which is also what SQLite's WAL mode needs.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


class SubmissionLocks:
    def __init__(self, cache_path: Path):
        self.cache_path = cache_path

    def _path(self, token: str) -> Path:
        return self.cache_path.with_name(f"{self.cache_path.name}.{token}.lock")

    @contextmanager
    def held(self, token: str) -> Iterator[None]:
        """Holds the lock of `token` (a fresh one, so never contended) for the body of the `with`."""
        path = self._path(token)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            # Removed before it is unlocked: a waiter then sees either a held lock or no file (both mean: re-read).
            path.unlink(missing_ok=True)
            os.close(fd)

    def is_held(self, token: str) -> bool:
        try:
            fd = os.open(self._path(token), os.O_RDWR)
        except FileNotFoundError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        finally:
            os.close(fd)  # also unlocks it, if this call took the lock
        return False

    def discard(self, token: str) -> None:
        """Removes the lock file a dead submitter left behind."""
        self._path(token).unlink(missing_ok=True)
