"""Strict parsing of a judge's verdict: the last non-empty line must be `<prefix>: A` or `<prefix>: B`.

Strict on purpose: a verdict found anywhere else in the text (e.g. "A is better ... but B") is not
guessed at. Only formatting noise on the verdict line is tolerated: case, Markdown emphasis, quotes
and a final full stop (`**Preferred:** "A".`). Anything else is a parse failure, which the caller
answers with one re-ask and then a counted `parse_error`.
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Literal

SlotVerdict = Literal["A", "B", "tie"]

_NOISE = r"[\s*_`'\"]*"


@lru_cache(maxsize=16)
def _verdict_re(prefix: str) -> re.Pattern[str]:
    return re.compile(rf"^[\s*_#>`'\"]*{re.escape(prefix)}{_NOISE}:{_NOISE}([AB]){_NOISE}\.?{_NOISE}$", re.IGNORECASE)


def parse_verdict(text: str | None, prefix: str = "Preferred") -> Literal["A", "B"] | None:
    """`"A"` or `"B"` from the final line of `text`, or None when that line is not a verdict."""
    if not text:
        return None
    lines = [line for line in text.strip().splitlines() if line.strip()]
    if not lines:
        return None
    match = _verdict_re(prefix).match(lines[-1])
    return match.group(1).upper() if match else None  # type: ignore[return-value]


def parse_label(value: object, prefix: str = "Preferred") -> SlotVerdict | None:
    """A python judge's return value: `"A"`, `"B"`, `"tie"` (any case) or judge text ending in a verdict line."""
    if not isinstance(value, str):
        return None
    label = value.strip().strip("\"'").lower()
    if label in ("a", "b"):
        return label.upper()  # type: ignore[return-value]
    if label == "tie":
        return "tie"
    return parse_verdict(value, prefix)
