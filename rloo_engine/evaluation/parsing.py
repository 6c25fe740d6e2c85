"""Parsing a judge's verdict: exactly one slot named by `<prefix>: A|B` lines, or no verdict at all.

A verdict line is `<prefix>: A` or `<prefix>: B` ending its line; it may follow prose on the same
line (`... so B is better. Preferred: B`), be followed by more lines of prose, name the slot
(`Preferred: Summary A`, `Response B`, `Answer A`) and carry formatting noise (case, Markdown
emphasis, quotes, a final full stop: `**Preferred:** "A".`). Each of these costs a paid re-ask when
refused, and none of them is ambiguous.

Still refused: no verdict line, verdict lines naming different slots ("Preferred: A ... Preferred:
B"), and anything after the letter on its line ("Preferred: A or B", "Preferred: A, but B ...",
"Preferred: A/B"). A verdict is never guessed from prose such as "A is better". The caller answers a
refusal with one re-ask and then a counted `parse_error`.
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Literal

SlotVerdict = Literal["A", "B", "tie"]

# Bump when `parse_verdict` accepts or refuses anything it did not before: cached parse_errors written
# under another version are parsed again from their stored replies (no request), see `OpenAIJudge.reparse`.
PARSER_VERSION = 1

_NOISE = r"[\s*_`'\"]*"
_SLOT_NAME = r"(?:(?:summary|response|answer|option)\s+)?"


@lru_cache(maxsize=16)
def _verdict_re(prefix: str) -> re.Pattern[str]:
    # The prefix starts a word (not "...Preferred" inside another word); the letter ends the line.
    return re.compile(
        rf"(?<![\w]){re.escape(prefix)}{_NOISE}:{_NOISE}{_SLOT_NAME}{_NOISE}([AB]){_NOISE}\.?{_NOISE}$", re.IGNORECASE
    )


def parse_verdict(text: str | None, prefix: str = "Preferred") -> Literal["A", "B"] | None:
    """`"A"` or `"B"` when every verdict line of `text` names that slot; None when none does or they disagree."""
    if not text:
        return None
    pattern = _verdict_re(prefix)
    slots = {m.group(1).upper() for line in text.splitlines() if (m := pattern.search(line.strip()))}
    return slots.pop() if len(slots) == 1 else None  # type: ignore[return-value]


def parse_label(value: object, prefix: str = "Preferred") -> SlotVerdict | None:
    """A python judge's return value: `"A"`, `"B"`, `"tie"` (any case) or judge text with a verdict line."""
    if not isinstance(value, str):
        return None
    label = value.strip().strip("\"'").lower()
    if label in ("a", "b"):
        return label.upper()  # type: ignore[return-value]
    if label == "tie":
        return "tie"
    return parse_verdict(value, prefix)
