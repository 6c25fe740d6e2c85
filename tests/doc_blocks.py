"""The fenced blocks of README.md and docs/*.md, with the `<!-- doc-test: ... -->` marker that says how each is tested.

A marker is the line right above a block's opening fence:

- `<!-- doc-test: run NAME -->`: tests/test_doc_blocks.py runs it (blocks sharing NAME run in order, as one session);
- `<!-- doc-test: config MODEL -->`: a YAML block validated by the real config class (`engine`, `eval`,
  `eval-fragment`, `pipeline-fragment`, `template`);
- `<!-- doc-test: covered PATH:TOKEN ... -->`: another test or script runs it; PATH must contain TOKEN;
- `<!-- doc-test: not-run REASON -->`: cannot run in CI, and the reason says why (the count is printed).

Every block in a language that holds commands or configuration (CHECKED_LANGUAGES) needs a marker.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CHECKED_LANGUAGES = {"bash", "sh", "shell", "console", "yaml", "yml", "python", "json", "toml"}
MARKER = re.compile(r"^\s*<!--\s*doc-test:\s*(run|config|covered|not-run)\s+(.+?)\s*-->\s*$")
FENCE = re.compile(r"^(\s*)(```+)(\S*)\s*$")


@dataclass(frozen=True)
class DocBlock:
    path: Path
    line: int  # 1-based line of the opening fence
    language: str
    text: str
    kind: str | None  # the marker's kind, None when the block has no marker
    argument: str

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}"


def doc_files() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def blocks(path: Path) -> list[DocBlock]:
    """Every fenced block of `path`, its text de-indented to the fence's indentation (blocks inside list items)."""
    lines = path.read_text(encoding="utf-8").splitlines()
    found, i = [], 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        indent, ticks, language = fence.groups()
        end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == ticks)
        body = "\n".join(ln[len(indent):] if ln.startswith(indent) else ln.lstrip() for ln in lines[i + 1:end])
        marker = MARKER.match(lines[i - 1]) if i > 0 else None
        found.append(DocBlock(path, i + 1, language.lower(), body + "\n", marker.group(1) if marker else None,
                              marker.group(2) if marker else ""))
        i = end + 1
    return found


def all_blocks() -> list[DocBlock]:
    return [b for path in doc_files() for b in blocks(path)]


def checked_blocks() -> list[DocBlock]:
    return [b for b in all_blocks() if b.language in CHECKED_LANGUAGES]


def run_blocks(name: str) -> list[DocBlock]:
    """The blocks marked `run NAME`, in document order (README first, then docs/ by name)."""
    return [b for b in checked_blocks() if b.kind == "run" and b.argument == name]


def commands(text: str) -> list[str]:
    """A shell block's commands: continuation lines joined, comment lines and trailing `# ...` comments dropped
    (a `#` inside quotes is kept)."""
    joined = re.sub(r"\\\n\s*", " ", text)
    out = []
    for line in joined.splitlines():
        stripped = _strip_comment(line).strip()
        if stripped:
            out.append(stripped)
    return out


def _strip_comment(line: str) -> str:
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i]
    return line
