"""A requests-per-minute limiter for asyncio: requests are spaced evenly, never in bursts."""

from __future__ import annotations

import asyncio
import time


class RateLimiter:
    """Grants at most `requests_per_minute` starts per minute, at least 60/rpm seconds apart.

    Each caller reserves the next free start time under a lock and then sleeps outside it, so
    waiting callers queue in order without holding the lock (and the event loop stays free).
    """

    def __init__(self, requests_per_minute: float | None):
        self.interval = 60.0 / requests_per_minute if requests_per_minute else 0.0
        self._next = 0.0
        self._lock = asyncio.Lock()

    async def wait(self) -> None:
        if not self.interval:
            return
        async with self._lock:
            now = time.monotonic()
            start = max(now, self._next)
            self._next = start + self.interval
        if start > now:
            await asyncio.sleep(start - now)
