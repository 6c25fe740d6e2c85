"""Eval prompts and completions: loading, stable prompt ids, and the completions JSONL format.

A prompt id is a hash of the prompt itself (with its image references when it has images, `images.py`), so the
same prompt has the same id in every file, run and model, and completions from different sources line up without
relying on row order. Completions JSONL rows are `{"prompt_id", "prompt", "completion"}`, with `images` (the
references) for a prompt with images; files written elsewhere may leave out either `prompt_id` or `prompt`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rloo_engine.config_base import ConfigError
from rloo_engine.evaluation.images import PromptImages, load_row_images
from rloo_engine.vision import has_images

log = logging.getLogger(__name__)

Prompt = str | list[dict[str, Any]]  # plain text, or chat messages [{"role": ..., "content": ...}]

# JSON can spell half of a UTF-16 pair ("\ud83d"): json.loads gives a str no UTF-8 encoder accepts.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")
NO_IMAGES = PromptImages((), ())


@dataclass(frozen=True)
class EvalPrompt:
    prompt_id: str
    prompt: Prompt
    reference: str | None = None  # the reference completion (a side of the *_vs_reference pairings)
    reference_answer: str | None = None  # the gold answer a reference-guided judge template is shown
    # References of the prompt's images (images.py): in its id and its judge cache keys; the judge sees text only.
    images: tuple[str, ...] = ()
    image_sources: tuple[Any, ...] = field(default=(), compare=False, repr=False)  # what generation opens


def prompt_id(prompt: Prompt, images: Sequence[str] = ()) -> str:
    """Stable id of a prompt: the first 16 hex digits of the SHA-256 of its text (or canonical JSON of its messages),
    or, for a prompt with images, of the canonical JSON of the prompt and its image references (a prompt without
    images keeps the id it had before images existed)."""
    canonical = prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True, ensure_ascii=False)
    if images:
        canonical = json.dumps({"prompt": prompt, "images": list(images)}, sort_keys=True, ensure_ascii=False)
    # surrogatepass: loaded text never holds a lone surrogate (see `without_lone_surrogates`), others' may.
    return hashlib.sha256(canonical.encode("utf-8", "surrogatepass")).hexdigest()[:16]


def without_lone_surrogates(value: Any) -> Any:
    """`value` (a parsed JSON value) with every lone UTF-16 surrogate in its strings replaced by U+FFFD.

    Such a surrogate is half a character (an emoji cut by a tool that counts UTF-16 units). It cannot be
    sent to a judge, stored in SQLite or written as UTF-8, so it becomes what any UTF-8 decoder shows
    for broken text, once, where it enters.
    """
    if isinstance(value, str):
        return _LONE_SURROGATE.sub("\ufffd", value)
    if isinstance(value, list):
        return [without_lone_surrogates(v) for v in value]
    if isinstance(value, dict):
        return {without_lone_surrogates(k): without_lone_surrogates(v) for k, v in value.items()}
    return value


def prompt_text(prompt: Prompt) -> str:
    """The prompt as the judge sees it: the text itself, or `role: content` paragraphs for chat messages."""
    if isinstance(prompt, str):
        return prompt
    return "\n\n".join(f"{m.get('role', 'user')}: {_shown_content(m.get('content', ''))}" for m in prompt)


def _shown_content(content: Any) -> Any:
    """A message's content as the judge sees it: content parts holding an image item (TRL's multimodal messages)
    as their text parts, since the judge sees text only; any other content as it is, so its keys stay."""
    if isinstance(content, list) and any(isinstance(p, dict) and p.get("type") == "image" for p in content):
        return "\n".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    return content


def _check_prompt(value: Any, where: str) -> Prompt:
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(m, dict) and "content" in m for m in value):
        return value
    raise ConfigError(f"{where}: {str(value)[:80]!r}; expected a string or a list of {{role, content}} messages")


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a JSONL file, with errors naming the file and line."""
    return [row for row, _ in read_jsonl_numbered(path)]


def read_jsonl_numbered(path: str | Path) -> list[tuple[dict[str, Any], int]]:
    """(row, line number) of each non-empty line of a JSONL file, with errors naming the file and line."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{p}: does not exist or is not a file; expected a JSONL file")
    rows = []
    with p.open("rb") as f:  # bytes, so that a line that is not UTF-8 is reported with its number
        for lineno, raw in enumerate(f, 1):
            line = utf8_text(raw, p, lineno)
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise ConfigError(f"{p}:{lineno}: not valid JSON: {err}") from None
            if not isinstance(row, dict):
                raise ConfigError(f"{p}:{lineno}: a {type(row).__name__}; expected a JSON object per line")
            if _SURROGATE_ESCAPE.search(line):  # a surrogate escape, maybe of a whole pair: look closer
                row = _clean_row(row, f"{p}:{lineno}")
            rows.append((row, lineno))
    return rows


def utf8_text(raw: bytes, path: Path, first_line: int = 1) -> str:
    """`raw` decoded as UTF-8; a ConfigError naming the file, line and byte when it is not UTF-8."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        line_start = raw.rfind(b"\n", 0, err.start) + 1
        lineno = first_line + raw.count(b"\n", 0, err.start)
        raise ConfigError(
            f"{path}:{lineno}: not valid UTF-8 (byte 0x{raw[err.start]:02x} at column {err.start - line_start + 1}); "
            "expected a UTF-8 text file (re-encode it, e.g. iconv -f latin1 -t utf-8)"
        ) from None


def _clean_row(row: dict[str, Any], where: str) -> dict[str, Any]:
    cleaned = without_lone_surrogates(row)
    if cleaned != row:
        log.warning("%s: a lone UTF-16 surrogate (half a character) was replaced with U+FFFD", where)
    return cleaned


def _read_rows(source: str, split: str) -> list[dict[str, Any]]:
    """Rows of the prompt set: JSONL/JSON read directly, other files and datasets through `datasets`."""
    p = Path(source)
    if p.suffix in (".jsonl", ".json"):
        if not p.is_file():
            raise ConfigError(f"prompts: {p} does not exist or is not a file")
        if p.suffix == ".jsonl":
            return read_jsonl(p)
        text = utf8_text(p.read_bytes(), p)
        if text.lstrip().startswith("["):
            try:
                data = json.loads(text)
            except json.JSONDecodeError as err:
                raise ConfigError(f"{p}:{err.lineno}: not valid JSON: {err.msg}") from None
            if not all(isinstance(r, dict) for r in data):
                raise ConfigError(f"prompts: {p} holds a list that is not all objects; expected one object per prompt")
            return [_clean_row(r, f"{p} row {i}") for i, r in enumerate(data)]
        return read_jsonl(p)
    import datasets  # imported here: it is slow to import and most evaluations read JSONL

    if p.suffix in (".parquet", ".csv"):
        if not p.is_file():
            raise ConfigError(f"prompts: {p} does not exist")
        ds = datasets.load_dataset(p.suffix[1:], data_files=str(p), split="train")
    elif p.is_dir():
        ds = datasets.load_from_disk(str(p))
        if isinstance(ds, datasets.DatasetDict):
            if split not in ds:
                raise ConfigError(f"split: {split!r} is not in {p} (splits: {sorted(ds)})")
            ds = ds[split]
    else:
        ds = datasets.load_dataset(source, split=split)
    return list(ds)


def load_prompts(
    source: str,
    *,
    split: str = "test",
    prompt_column: str = "prompt",
    reference_column: str | None = None,
    reference_answer_column: str | None = None,
    max_prompts: int | None = None,
) -> list[EvalPrompt]:
    """Loads the eval prompt set, dropping repeated prompts (one id per prompt) with a warning. A row's `image` or
    `images` are opened here, so a broken image fails before any model loads."""
    rows = _read_rows(source, split)
    image_dir = Path(source).parent if Path(source).is_file() else None  # relative image paths start here
    prompts: list[EvalPrompt] = []
    seen: set[str] = set()
    for i, row in enumerate(rows):
        if prompt_column not in row:
            raise ConfigError(
                f"prompt_column: {prompt_column!r} is not a column of {source} (row {i} has {sorted(row)})"
            )
        prompt = _check_prompt(row[prompt_column], f"{source} row {i} column {prompt_column!r}")
        reference = _optional_text(row, i, "reference_column", reference_column, source)
        reference_answer = _optional_text(row, i, "reference_answer_column", reference_answer_column, source)
        if reference_answer is not None and not reference_answer.strip():
            reference_answer = None  # a blank gold answer is no answer: counted as missing, never shown empty
        pictures = load_row_images(row, image_dir, f"prompts: {source} row {i}") if has_images(row) else NO_IMAGES
        pid = prompt_id(prompt, pictures.references)
        if pid in seen:
            continue
        seen.add(pid)
        prompts.append(EvalPrompt(pid, prompt, reference, reference_answer, pictures.references, pictures.sources))
        if max_prompts is not None and len(prompts) >= max_prompts:
            break
    if len(prompts) < len(rows) and max_prompts is None:
        log.warning("prompts: %s has %d repeated prompts; each is evaluated once", source, len(rows) - len(prompts))
    if not prompts:
        raise ConfigError(f"prompts: {source} has no prompts")
    return prompts


def _optional_text(row: dict[str, Any], i: int, field: str, column: str | None, source: str) -> str | None:
    """Row `i`'s text in `column` (named by the config field `field`); None when there is no column or no value
    (a prompt without one is counted as missing by the caller)."""
    if column is None:
        return None
    if column not in row:
        raise ConfigError(f"{field}: {column!r} is not a column of {source} (row {i} has {sorted(row)})")
    value = row[column]
    if value is not None and not isinstance(value, str):
        raise ConfigError(f"{field}: row {i} of {source} holds {type(value).__name__}; expected text")
    return value


def _image_references(row: dict[str, Any], path: str | Path, lineno: int) -> list[str]:
    references = row.get("images") or []
    if not isinstance(references, list) or not all(isinstance(r, str) for r in references):
        raise ConfigError(f"{path}:{lineno}: images {str(references)[:80]!r}; expected a list of image references "
                          "(the paths or sha256: hashes an evaluation writes)")
    return references


def save_completions(path: str | Path, prompts: list[EvalPrompt], completions: dict[str, str]) -> Path:
    """Writes `{prompt_id, prompt, completion}` rows (in prompt order) to a JSONL file, atomically."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(p.suffix + ".tmp")
    with tmp.open("w", encoding="utf-8") as f:
        for ep in prompts:
            if ep.prompt_id in completions:
                row = {"prompt_id": ep.prompt_id, "prompt": ep.prompt, "completion": completions[ep.prompt_id]}
                if ep.images:
                    row["images"] = list(ep.images)
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
    tmp.replace(p)
    return p


def load_completions(path: str | Path) -> dict[str, str]:
    """`{prompt_id: completion}` from a completions JSONL file; ids are recomputed from `prompt` (and `images`, the
    image references of a prompt with images) when present.

    Refuses an empty file and a prompt id given twice (naming both lines): silently keeping one of
    two completions would change the result depending on row order.
    """
    out: dict[str, str] = {}
    first_line: dict[str, int] = {}
    for row, lineno in read_jsonl_numbered(path):
        if not isinstance(row.get("completion"), str):
            raise ConfigError(
                f"{path}:{lineno}: no text `completion` field; expected {{prompt or prompt_id, completion}}"
            )
        if "prompt" in row:
            prompt = _check_prompt(row["prompt"], f"{path}:{lineno} prompt")
            pid = prompt_id(prompt, _image_references(row, path, lineno))
            if "prompt_id" in row and row["prompt_id"] != pid:
                raise ConfigError(
                    f"{path}:{lineno}: prompt_id {row['prompt_id']!r} does not match the hash of its prompt ({pid}); "
                    "was the prompt edited?"
                )
        elif isinstance(row.get("prompt_id"), str):
            pid = row["prompt_id"]
        else:
            raise ConfigError(
                f"{path}:{lineno}: neither `prompt` nor `prompt_id`; expected one to match the prompt set"
            )
        if pid in first_line:
            raise ConfigError(
                f"{path}:{lineno}: duplicate completion for prompt_id {pid} (first given on line {first_line[pid]}); "
                "expected one completion per prompt"
            )
        first_line[pid] = lineno
        out[pid] = row["completion"]
    if not out:
        raise ConfigError(f"{path}: has no completions; expected one {{prompt or prompt_id, completion}} per line")
    return out
