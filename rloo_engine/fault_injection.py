"""Fault injection for the reliability tests: SIGKILL this process at a named point of a given step.

RLOO_ENGINE_KILL_AT=STEP:POINT kills the engine (no cleanup, as the OOM killer would) at POINT of
optimizer step STEP: `step` (the update is done, nothing logged), `logged` (metrics written),
`checkpoint-partial` (inside the checkpoint write: optimizer and RNG state written, model not yet),
`checkpoint-written` (every file written, not yet renamed into place).
"""

from __future__ import annotations

import os
import signal
import sys

KILL_ENV = "RLOO_ENGINE_KILL_AT"
STEP_POINTS = ("step", "logged")
CHECKPOINT_POINTS = ("checkpoint-partial", "checkpoint-written")
KILL_POINTS = STEP_POINTS + CHECKPOINT_POINTS


def maybe_kill(step: int, point: str) -> None:
    if os.environ.get(KILL_ENV) == f"{step}:{point}":
        print(f"rloo-engine: {KILL_ENV}={step}:{point} reached; SIGKILL", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
