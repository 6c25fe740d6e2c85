"""Retry timing for judge requests: exponential backoff with jitter, and the server's `Retry-After`."""

from __future__ import annotations

import email.utils
import math
import random
import time
from collections.abc import Mapping
from dataclasses import dataclass

RETRYABLE_STATUS = frozenset({408, 409, 429}) | frozenset(range(500, 600))
FATAL_STATUS = frozenset({401, 403, 404})


@dataclass(frozen=True)
class RetryPolicy:
    max_attempts: int = 6
    initial_s: float = 1.0
    max_s: float = 60.0

    def delay(self, attempt: int, retry_after_s: float | None = None, rng: random.Random | None = None) -> float:
        """Seconds to wait after failed attempt number `attempt` (1-based).

        A server's Retry-After wins (capped at `max_s`), since it knows when capacity returns.
        Otherwise "equal jitter": half of `initial_s * 2**(attempt-1)` fixed, half random, so
        clients that failed together do not retry together.
        """
        if retry_after_s is not None:
            return min(max(retry_after_s, 0.0), self.max_s)
        ceiling = min(self.max_s, self.initial_s * 2 ** (attempt - 1))
        return ceiling / 2 + (rng or random).uniform(0, ceiling / 2)


def retry_after_seconds(headers: Mapping[str, str] | None, now: float | None = None) -> float | None:
    """Delay asked for by `retry-after-ms` or `Retry-After` (seconds or an HTTP date); None if absent or unreadable.

    `nan`, `inf` and negative numbers count as unreadable: the caller then backs off as if no header came
    (a NaN would slip through `min`/`max` and make the cap on the delay meaningless).
    """
    if not headers:
        return None
    ms = _delay_number(headers.get("retry-after-ms"))
    if ms is not None:
        return ms / 1000.0
    value = headers.get("retry-after")
    if value is None:
        return None
    seconds = _delay_number(value)
    if seconds is not None:
        return seconds
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - (time.time() if now is None else now))


def _delay_number(value: str | None) -> float | None:
    """`value` as a finite, non-negative number; None for anything else."""
    if value is None:
        return None
    try:
        number = float(value)
    except ValueError:
        return None
    return number if math.isfinite(number) and number >= 0 else None
