"""Fault injection for the reliability tests: SIGKILL at a named point of a step, or exit as a crash after a step.

RLOO_ENGINE_CRASH_AT_STEP=N exits with code 3 after optimizer step N (and its checkpoint, if one is due), on
every rank together, unless the run resumed past N: the retry tests' stand-in for a crashed node.

RLOO_ENGINE_KILL_AT=STEP:POINT kills the engine (no cleanup, as the OOM killer would) at POINT of
optimizer step STEP: `step` (the update is done, nothing logged), `logged` (metrics written),
`checkpoint-partial` (inside the checkpoint write: optimizer and RNG state written, model not yet),
`checkpoint-written` (every file written, not yet renamed into place).
"""

from __future__ import annotations

import os
import signal
import sys

from rloo_engine import exit_codes

CRASH_ENV = "RLOO_ENGINE_CRASH_AT_STEP"
CRASH_EXIT_CODE = exit_codes.INJECTED_CRASH
KILL_ENV = "RLOO_ENGINE_KILL_AT"
STEP_POINTS = ("step", "logged")
CHECKPOINT_POINTS = ("checkpoint-partial", "checkpoint-written")
KILL_POINTS = STEP_POINTS + CHECKPOINT_POINTS


def maybe_kill(step: int, point: str) -> None:
    if os.environ.get(KILL_ENV) == f"{step}:{point}":
        print(f"rloo-engine: {KILL_ENV}={step}:{point} reached; SIGKILL", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


def crash_step() -> int:
    """The step after which `CRASH_ENV` asks the run to exit; 0 = never."""
    return int(os.environ.get(CRASH_ENV, "0"))


def crash(step: int) -> None:
    print(f"rloo-engine: {CRASH_ENV}={step} reached; exiting to simulate a crash", file=sys.stderr)
    sys.exit(CRASH_EXIT_CODE)
