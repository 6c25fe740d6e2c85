"""Die with the parent: `PR_SET_PDEATHSIG` (Linux), so no training process outlives the process that launched it.

A SIGKILLed flow-run process runs no `finally`, so it cannot kill the training group itself; the kernel
sends SIGKILL to each process that asked for it when its parent dies. The pipeline's launcher asks for
its child (`accelerate launch`) and sets RLOO_DIE_WITH_PARENT, and the engine asks again at start-up,
so every rank dies with the launcher too. Elsewhere (macOS) these are no-ops.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

DIE_WITH_PARENT_ENV = "RLOO_DIE_WITH_PARENT"
_PR_SET_PDEATHSIG = 1
# Loaded now, not in the forked child: dlopen after fork in a threaded process can deadlock.
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def die_with_parent(expected_parent: int | None = None) -> None:
    """SIGKILL this process when its parent dies (usable as a `subprocess` preexec_fn: no imports, no locks).

    With `expected_parent`, a parent that already died before the request took effect kills us at once.
    """
    if _LIBC is None:
        return
    _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if expected_parent is not None and os.getppid() != expected_parent:
        os.kill(os.getpid(), signal.SIGKILL)


def die_with_parent_if_asked() -> None:
    """Called by the engine at start-up; applies `die_with_parent` when the launcher set RLOO_DIE_WITH_PARENT."""
    if os.environ.get(DIE_WITH_PARENT_ENV) != "1" or _LIBC is None:
        return
    die_with_parent(os.getppid())
