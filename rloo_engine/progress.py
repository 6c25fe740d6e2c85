"""Progress bars that suit where the output goes: a tqdm bar on a terminal, a few plain lines in a log file.

A tqdm bar redraws itself with carriage returns; captured to a file (a CI log, `demo.sh > log`, a
Prefect worker) every redraw becomes text, and nested bars wrote most of a demo log's lines. When
the stream is not a terminal, `progress_bar` returns a `PlainProgress` instead, which prints one line
each time another tenth of the work is done (and at least every `interval` seconds when a tenth takes
long), then a final line, with the rate and the time left as tqdm shows them, e.g.

    demo assets: SFT policy: 120/600 step (20%), 14 s, 8.57 step/s, ETA 0:56, loss=2.314

The rate counts only the work done since the bar started (a resumed run's earlier steps took no time here).
`metric_line` is the line a trainer prints at each logging step, the dict TRL prints there:

    {'loss': 0.01234, 'reward': 1.2, 'kl': 3.2e-05, 'epoch': 0.1}
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterable, Iterator
from typing import Any, TextIO

PLAIN_INTERVAL_ENV = "RLOO_PROGRESS_INTERVAL"  # seconds between plain lines when a tenth takes longer


def is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # replaced or closed streams
        return False


def progress_bar(iterable: Iterable | None = None, *, total: int | None = None, desc: str = "", unit: str = "it",
                 disable: bool = False, initial: int = 0, file: TextIO | None = None, **tqdm_kwargs: Any):
    """`tqdm(...)` on a terminal, `PlainProgress(...)` otherwise; both support iteration, update,
    set_postfix, set_postfix_str and close. tqdm writes to stderr, so that is the stream checked."""
    stream = file or sys.stderr
    if is_terminal(stream):
        from tqdm.auto import tqdm

        return tqdm(iterable, total=total, desc=desc, unit=unit, disable=disable, initial=initial, file=file,
                    **tqdm_kwargs)
    interval = float(os.environ.get(PLAIN_INTERVAL_ENV, "30"))
    return PlainProgress(iterable, total=total, desc=desc, unit=unit, disable=disable, initial=initial,
                         stream=stream, interval=interval)


def format_metric(value: float) -> str:
    """Four significant digits, as transformers prints logged floats: a KL of 3.2e-05 is not `0.000`."""
    return f"{value:.4g}"


def metric_line(metrics: dict[str, float]) -> str:
    """A logging step's metrics as TRL (transformers' progress callback) prints them, floats to 4 significant digits."""
    return "{" + ", ".join(f"'{k}': {format_metric(v) if isinstance(v, float) else v}" for k, v in metrics.items()) + "}"


def format_duration(seconds: float) -> str:
    """tqdm's clock format: m:ss, or h:mm:ss from an hour on."""
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


class PlainProgress:
    """Throttled plain-line progress: a line per tenth of `total` (or per `interval` seconds), and one at the end."""

    def __init__(self, iterable: Iterable | None = None, *, total: int | None = None, desc: str = "", unit: str = "it",
                 disable: bool = False, initial: int = 0, stream: TextIO | None = None, interval: float = 30.0):
        self.iterable = iterable
        if total is None and iterable is not None and hasattr(iterable, "__len__"):
            total = len(iterable)  # type: ignore[arg-type]
        self.total, self.desc, self.unit, self.disable = total, desc, unit, disable
        self.n = self.initial = initial
        self.stream = stream or sys.stderr
        self.interval = interval
        self.postfix = ""
        self.start = self.last_print = time.monotonic()
        self.tenths_printed = self._tenths()
        self.printed_n: int | None = None
        self.closed = False

    def __iter__(self) -> Iterator:
        if self.iterable is None:
            raise TypeError("PlainProgress without an iterable is not iterable; call update() instead")
        for item in self.iterable:
            yield item
            self.update(1)
        self.close()

    def __enter__(self) -> PlainProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _tenths(self) -> int:
        return 10 * self.n // self.total if self.total else 0

    def update(self, n: int = 1) -> None:
        self.n += n
        now = time.monotonic()
        if self._tenths() > self.tenths_printed or now - self.last_print >= self.interval:
            self.tenths_printed = self._tenths()
            self._print(now)

    def set_postfix(self, ordered_dict: dict | None = None, refresh: bool = True, **kwargs: Any) -> None:
        items = {**(ordered_dict or {}), **kwargs}
        self.postfix = ", ".join(f"{k}={v}" for k, v in items.items())

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        self.postfix = s

    def set_description(self, desc: str | None = None, refresh: bool = True) -> None:
        self.desc = desc or ""

    def refresh(self) -> None:
        pass

    def write(self, s: str, file: TextIO | None = None) -> None:
        print(s, file=file or self.stream, flush=True)

    def close(self) -> None:
        """The final line, unless the last line printed already says the same."""
        if not self.closed and self.printed_n != self.n:
            self._print(time.monotonic())
        self.closed = True

    def _print(self, now: float) -> None:
        if self.disable:
            return
        self.last_print, self.printed_n = now, self.n
        done = f"{self.n}/{self.total} {self.unit}" if self.total else f"{self.n} {self.unit}"
        pct = f" ({100 * self.n // self.total}%)" if self.total else ""
        post = f", {self.postfix}" if self.postfix else ""
        print(f"{self.desc}: {done}{pct}, {now - self.start:.0f} s{self._rate_and_eta(now)}{post}", file=self.stream,
              flush=True)

    def _rate_and_eta(self, now: float) -> str:
        """`, 8.57 step/s, ETA 0:56` (tqdm turns a rate under 1/s into seconds per unit); empty before any work."""
        done, elapsed = self.n - self.initial, now - self.start
        if done <= 0 or elapsed <= 0:
            return ""
        rate = done / elapsed
        shown = f"{rate:.3g} {self.unit}/s" if rate >= 1 else f"{1 / rate:.3g} s/{self.unit}"
        eta = f", ETA {format_duration((self.total - self.n) / rate)}" if self.total and self.n < self.total else ""
        return f", {shown}{eta}"
