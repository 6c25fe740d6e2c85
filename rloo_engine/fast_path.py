"""One rule for the fast paths: each is checked once, at start-up, against the plain path it replaces.

The fast paths (chunked log-probs, the shared prompt forward, the fused decoding loop, the reward model's shared
prompt prefix) each compute what a plain path computes, faster. Before a run uses one, `fast_path_holds` measures
it against the plain path on a fixed probe: a model it cannot run (`measure` returns the reason), an error while
measuring (a layout it misreads), or a difference above the tolerance keeps the plain path, with one line in one
format: `rloo-engine: <name>: <why>; <fallback>`.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

# Rounding of the same function over other matmul shapes: float32 kernels, and half precision (bf16/fp16). A
# transform the fast path misses (a logit scale, soft-capping, a cache it misindexes) is far above either.
FLOAT32_TOLERANCE = 1e-4
HALF_PRECISION_TOLERANCE = 5e-2

# What a probe of a model the fast path misreads raises (shapes, attributes, a cache it cannot index).
PROBE_ERRORS = (RuntimeError, TypeError, ValueError, AttributeError, IndexError)


def is_half_precision(mixed_precision: str | None, dtype: str | None) -> bool:
    """Whether the forward runs in bf16/fp16: autocast (`bf16`/`fp16`) or half-precision weights."""
    return mixed_precision in ("bf16", "fp16") or dtype in ("bfloat16", "float16")


def tolerance_for(half_precision: bool) -> float:
    return HALF_PRECISION_TOLERANCE if half_precision else FLOAT32_TOLERANCE


def stderr(message: str) -> None:
    print(message, file=sys.stderr)


def fast_path_holds(name: str, measure: Callable[[], float | str], tolerance: float, fallback: str,
                    say: Callable[[str], None] = stderr) -> bool:
    """Whether the fast path `name` may run. `measure()` returns the largest difference from the plain path on its
    probe, or a string saying why the path cannot run this model at all. `fallback` says what runs instead."""
    try:
        result = measure()
    except PROBE_ERRORS as err:
        result = f"its check failed ({type(err).__name__}: {err})"
    if isinstance(result, str):
        why = result
    elif result <= tolerance:
        return True
    else:
        why = f"on a probe batch it is up to {result:.3g} away from the plain path (tolerance {tolerance:g})"
    say(f"rloo-engine: {name}: {why}; {fallback}")
    return False
