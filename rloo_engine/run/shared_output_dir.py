"""Checks, before any model loads, that every rank sees the same `output_dir`.

Checkpoints assume one filesystem across nodes: rank 0 creates `.tmp-checkpoint-N`, every rank writes its
own state into it, and rank 0 renames it. On nodes without a shared filesystem that fails only at the
first save, after the models loaded and steps ran. So rank 0 writes a token into `output_dir` at start-up,
every rank reads it back, and all ranks decide together: one rank that cannot see it makes every rank
raise the same error (a rank-local raise would leave the others blocked in their next collective).
"""

from __future__ import annotations

import socket
import time
import uuid
from pathlib import Path

from accelerate import Accelerator
from accelerate.utils import broadcast_object_list, gather_object

from rloo_engine.config_base import ConfigError

TOKEN_NAME = ".rloo-engine-shared-check"
VISIBILITY_WAIT_S = 5.0  # NFS attribute caching can hide a new file from another client for a few seconds


class OutputDirNotShared(ConfigError):
    """A rank cannot read what rank 0 wrote into output_dir: the nodes do not share a filesystem there."""


def check_output_dir_shared(acc: Accelerator, output_dir: str | Path) -> None:
    """Collective: every rank must call it. Raises OutputDirNotShared on every rank if any rank cannot read
    rank 0's token; the message names each such rank, its host and the path it looked at."""
    if acc.num_processes == 1:
        return
    path = Path(output_dir) / TOKEN_NAME
    token = [uuid.uuid4().hex if acc.is_main_process else None]
    if acc.is_main_process:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(token[0])
    broadcast_object_list(token, from_process=0)
    acc.wait_for_everyone()  # rank 0 has written the file before anyone looks
    problem = _token_problem(path, token[0])
    reports = gather_object([(acc.process_index, socket.gethostname(), str(path.resolve()), problem)])
    acc.wait_for_everyone()  # everyone has read it before rank 0 removes it
    if acc.is_main_process:
        path.unlink(missing_ok=True)
    if failed := [r for r in reports if r[3] is not None]:
        raise OutputDirNotShared(not_shared_message(output_dir, failed))


def _token_problem(path: Path, expected: str) -> str | None:
    """None when `path` holds `expected`; otherwise what this rank saw, after waiting out attribute caching."""
    deadline = time.monotonic() + VISIBILITY_WAIT_S
    while True:
        try:
            seen = path.read_text()
            problem = None if seen == expected else "holds another run's token"
        except OSError as err:
            problem = f"cannot be read ({type(err).__name__}: {err.strerror or err})"
        if problem is None or time.monotonic() > deadline:
            return problem
        time.sleep(0.2)


def not_shared_message(output_dir: str | Path, failed: list[tuple[int, str, str, str]]) -> str:
    ranks = "; ".join(f"rank {rank} on {host}: {path} {problem}" for rank, host, path, problem in failed)
    return (f"output_dir: {output_dir} is not shared by every node; rank 0 wrote a token into it, and {ranks}. "
            "Checkpoints need one filesystem every node sees at the same path (NFS, Lustre, a shared volume); "
            "point output_dir at it")
