"""The JSONL files of a Batch API submission: the request lines uploaded, and the result lines downloaded,
read without trusting them (a line that is not a result is reported, never raised).

A request line is `{"custom_id", "method": "POST", "url": "/v1/chat/completions", "body"}`; the custom id
is a hash of the body, so the same judgment has the same id in every run.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

# A line cut short (or otherwise broken) usually still starts with its ids: enough to tell which row it was.
_CUSTOM_ID = re.compile(r'"custom_id"\s*:\s*"([^"\\]+)"')


def custom_id(body: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True, ensure_ascii=False).encode("utf-8")).hexdigest()[:40]


def request_line(cid: str, body: dict[str, Any]) -> bytes:
    """One line of the file to upload, newline included (its length counts toward the file's size)."""
    line = {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions", "body": body}
    return (json.dumps(line, ensure_ascii=False) + "\n").encode("utf-8")


def split_into_files(sizes: Sequence[int], max_rows: int, max_bytes: int) -> list[range]:
    """Consecutive runs of the lines of `sizes` (bytes each), every run at most `max_rows` lines and
    `max_bytes` bytes: the batch files to upload. A line larger than `max_bytes` alone raises ValueError."""
    files: list[range] = []
    start, total = 0, 0
    for i, size in enumerate(sizes):
        if size > max_bytes:
            raise ValueError(f"line {i} is {size} bytes, more than the {max_bytes} a file may hold")
        if i - start == max_rows or total + size > max_bytes:
            files.append(range(start, i))
            start, total = i, 0
        total += size
    if start < len(sizes):
        files.append(range(start, len(sizes)))
    return files


@dataclass
class BatchResults:
    """What the output and error files of one batch said, by custom id."""

    rows: dict[str, dict[str, Any]] = field(default_factory=dict)  # well-formed result lines
    malformed: dict[str, str] = field(default_factory=dict)  # custom id -> what is wrong with its line
    unreadable_lines: int = 0  # malformed lines whose custom id could not be read either

    def add_file(self, text: str) -> None:
        for line in text.splitlines():
            if line.strip():
                self._add_line(line)

    def _add_line(self, line: str) -> None:
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            problem = f"not JSON ({err.msg} at character {err.pos} of {len(line)})"
        else:
            problem = _result_problem(row)
            if problem is None:
                self.rows[row["custom_id"]] = row
                return
        found = _CUSTOM_ID.search(line)
        if found is None:
            self.unreadable_lines += 1
        else:
            self.malformed[found.group(1)] = problem


def _result_problem(row: Any) -> str | None:
    """Why `row` is not a result line of the Batch API, or None if it is one."""
    if not isinstance(row, dict) or not isinstance(row.get("custom_id"), str):
        return "not a result object with a custom_id"
    response, error = row.get("response"), row.get("error")
    if response is not None and not isinstance(response, dict):
        return f"`response` is a {type(response).__name__}, not an object"
    if error is not None and not isinstance(error, dict):
        return f"`error` is a {type(error).__name__}, not an object"
    return None
