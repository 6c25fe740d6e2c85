"""SQLite judgment cache: one row per judged SlotPair, written the moment the judgment returns.

The key hashes the judge identity (backend, model, template hash, decoding parameters) with the
prompt and both answers in their slots, so the order is part of the key, with the prompt's reference
answer when a reference-guided template shows one, and with the references of the prompt's images when it has
any (the judge sees text only; the same text over another image is another judgment). WAL mode with one commit
per row means a crash loses only the judgments still in flight, and readers (another run, a
progress monitor) never block the writer. The judge's raw replies are stored, so verdicts can be
re-parsed offline. `api_error` judgments are not stored: a rerun should try them again.

The `batches` table records every OpenAI Batch API submission (`judge.mode: batch`) before and after
it is created, so a crashed or cancelled run resumes polling the same batch and never submits the
same requests twice (see judges/openai_batch.py). A submission claims its requests in one
transaction, so two runs sharing the cache cannot both claim one.
"""

from __future__ import annotations

import functools
import hashlib
import json
import sqlite3
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

from rloo_engine.config_base import ConfigError
from rloo_engine.evaluation.judges.base import Judgment, SlotPair

Method = TypeVar("Method", bound=Callable[..., Any])

SCHEMA = """
CREATE TABLE IF NOT EXISTS judgments (
    key TEXT PRIMARY KEY,
    backend TEXT NOT NULL,
    model TEXT,
    template_hash TEXT,
    identity TEXT NOT NULL,
    prompt TEXT NOT NULL,
    answer_a TEXT NOT NULL,
    answer_b TEXT NOT NULL,
    status TEXT NOT NULL,
    verdict TEXT,
    raw_texts TEXT NOT NULL,
    prompt_tokens INTEGER NOT NULL,
    completion_tokens INTEGER NOT NULL,
    requests INTEGER NOT NULL,
    error TEXT,
    created_at REAL NOT NULL,
    batch_prompt_tokens INTEGER NOT NULL DEFAULT 0,
    batch_completion_tokens INTEGER NOT NULL DEFAULT 0,
    served_model TEXT,
    parser_version INTEGER,
    slot_a_probability REAL,
    reference TEXT,
    images TEXT
)
"""
# Columns that caches written by older versions lack, added on open (nothing else changes): the Batch API
# token counts (their judgments were all live), the served model id, the parser version (unknown: NULL,
# so their parse_errors are parsed again), the soft verdict, the reference answer and the image references
# (none: NULL).
_ADDED_COLUMNS = {
    "batch_prompt_tokens": "INTEGER NOT NULL DEFAULT 0",
    "batch_completion_tokens": "INTEGER NOT NULL DEFAULT 0",
    "served_model": "TEXT",
    "parser_version": "INTEGER",
    "slot_a_probability": "REAL",
    "reference": "TEXT",
    "images": "TEXT",
}
_ROW_COLUMNS = (
    "key, backend, model, template_hash, identity, prompt, answer_a, answer_b, status, verdict, raw_texts, "
    "prompt_tokens, completion_tokens, requests, error, created_at, batch_prompt_tokens, batch_completion_tokens, "
    "served_model, parser_version, slot_a_probability, reference, images"
)
BATCH_SCHEMA = """
CREATE TABLE IF NOT EXISTS batches (
    token TEXT PRIMARY KEY,      -- a fresh id per submission, sent as the batch's metadata too
    judge TEXT NOT NULL,         -- hash of the judge identity
    batch_id TEXT,               -- null while the submission is being created
    input_file_id TEXT,
    custom_ids TEXT NOT NULL,    -- JSON list
    state TEXT NOT NULL,         -- submitting, open, collected
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL
)
"""


def cache_key(identity: dict[str, Any], pair: SlotPair) -> str:
    """SHA-256 of the judge identity and the pair as shown (prompt, slot A answer, slot B answer, and the
    reference answer when there is one), with the prompt's image references when it has images. A pair without a
    reference or images keeps the key it had before those existed."""
    shown: dict[str, Any] = {"prompt": pair.prompt, "answer_a": pair.answer_a, "answer_b": pair.answer_b}
    if pair.reference is not None:
        shown["reference"] = pair.reference
    if pair.images:
        shown["images"] = list(pair.images)
    payload = json.dumps({"judge": identity, **shown}, sort_keys=True, ensure_ascii=False)
    # surrogatepass: a lone surrogate (half an emoji) gets a key of its own instead of an UnicodeEncodeError.
    return hashlib.sha256(payload.encode("utf-8", "surrogatepass")).hexdigest()


def corrupt_cache_message(path: Path, err: sqlite3.DatabaseError) -> str:
    return (
        f"cache_path: {path} is not a readable SQLite judgment cache ({err}). It was not deleted: move it aside "
        f"(e.g. mv {path} {path}.corrupt, with any {path.name}-wal and {path.name}-shm next to it) and rerun to "
        "start a fresh cache (everything is judged again), or point cache_path at another file"
    )


def _names_a_corrupt_file(method: Method) -> Method:
    """Turns SQLite's "file is not a database" / "disk image is malformed" into a ConfigError naming the file."""

    @functools.wraps(method)
    def wrapper(self: JudgmentCache, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except sqlite3.DatabaseError as err:
            # Only damage: "database is locked" and other OperationalErrors are DatabaseErrors too.
            if not str(getattr(err, "sqlite_errorname", "")).startswith(("SQLITE_CORRUPT", "SQLITE_NOTADB")):
                raise
            raise ConfigError(corrupt_cache_message(self.path, err)) from None

    return wrapper  # type: ignore[return-value]


class JudgmentCache:
    @_names_a_corrupt_file
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # Autocommit (isolation_level=None): each INSERT is its own transaction, durable on return.
        self._conn = sqlite3.connect(self.path, timeout=30.0, isolation_level=None, check_same_thread=False)
        try:
            self._prepare()
        except sqlite3.DatabaseError:
            self._conn.close()
            raise
        # put() gets the same identity dict for every judgment of a run: serialise it once per dict.
        self._identity_json: tuple[dict[str, Any], str] | None = None

    def _prepare(self) -> None:
        """WAL mode, the tables, and the columns that caches written by older versions lack."""
        self._conn.execute("PRAGMA journal_mode=WAL")
        # NORMAL is crash-safe for a killed process in WAL mode; only power loss can drop the last commits.
        self._conn.execute("PRAGMA synchronous=NORMAL")
        self._conn.execute(SCHEMA)
        self._conn.execute(BATCH_SCHEMA)
        columns = {row[1] for row in self._conn.execute("PRAGMA table_info(judgments)")}
        for name, kind in _ADDED_COLUMNS.items():
            if name not in columns:
                self._conn.execute(f"ALTER TABLE judgments ADD COLUMN {name} {kind}")

    def __enter__(self) -> JudgmentCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @_names_a_corrupt_file
    def get_many(self, keys: Iterable[str]) -> dict[str, Judgment]:
        keys = list(keys)
        found: dict[str, Judgment] = {}
        for start in range(0, len(keys), 500):
            chunk = keys[start : start + 500]
            rows = self._conn.execute(
                "SELECT key, status, verdict, raw_texts, prompt_tokens, completion_tokens, requests, error, "
                "batch_prompt_tokens, batch_completion_tokens, served_model, parser_version, slot_a_probability "
                f"FROM judgments WHERE key IN ({','.join('?' * len(chunk))})",
                chunk,
            )
            for key, status, verdict, raw, pt, ct, requests, error, bpt, bct, served, parser, soft in rows:
                found[key] = Judgment(
                    status, verdict, json.loads(raw), pt, ct, requests, error, bpt, bct, served, parser, soft
                )
        return found

    @_names_a_corrupt_file
    def put(self, key: str, identity: dict[str, Any], template_hash: str | None, pair: SlotPair, j: Judgment) -> None:
        if j.status == "api_error":
            return
        if self._identity_json is None or self._identity_json[0] is not identity:
            self._identity_json = (identity, json.dumps(identity, sort_keys=True))
        self._conn.execute(
            # Columns named: a migrated cache has the added ones in another order than a new one.
            f"INSERT OR REPLACE INTO judgments ({_ROW_COLUMNS}) VALUES ({','.join('?' * 23)})",
            (
                key,
                identity["backend"],
                identity.get("model") or identity.get("function"),
                template_hash,
                self._identity_json[1],
                pair.prompt,
                pair.answer_a,
                pair.answer_b,
                j.status,
                j.verdict,
                json.dumps(j.raw_texts, ensure_ascii=False),
                j.prompt_tokens,
                j.completion_tokens,
                j.requests,
                j.error,
                time.time(),
                j.batch_prompt_tokens,
                j.batch_completion_tokens,
                j.served_model,
                j.parser_version,
                j.slot_a_probability,
                pair.reference,
                json.dumps(list(pair.images), ensure_ascii=False) if pair.images else None,
            ),
        )

    # ------------------------------------------------------------------ Batch API submissions
    @_names_a_corrupt_file
    def unfinished_batches(self, judge: str, collected_since: float = float("inf")) -> list[dict[str, Any]]:
        """Submissions of this judge not yet collected, or collected at or after `collected_since` (by another run,
        after this one read the judgments): {token, batch_id (None while submitting), custom_ids, state, created_at}."""
        rows = self._conn.execute(
            "SELECT token, batch_id, custom_ids, state, created_at FROM batches WHERE judge = ? "
            "AND (state != 'collected' OR updated_at >= ?) ORDER BY created_at",
            (judge, collected_since),
        )
        return [
            {"token": t, "batch_id": b, "custom_ids": json.loads(c), "state": st, "created_at": at}
            for t, b, c, st, at in rows
        ]

    def batch_claim(
        self, token: str, judge: str, custom_ids: list[str], collected_since: float = float("inf")
    ) -> list[str]:
        """Records a submission (state `submitting`, before the batch is created, so a crash in between is noticed
        on resume) of those of `custom_ids` that no submission of `judge` listed by `unfinished_batches` holds,
        and returns them. One transaction: two runs sharing the cache never claim the same request."""
        self._conn.execute("BEGIN IMMEDIATE")  # takes the write lock now, so no other claim runs in between
        try:
            held = {c for sub in self.unfinished_batches(judge, collected_since) for c in sub["custom_ids"]}
            free = [c for c in custom_ids if c not in held]
            if free:
                now = time.time()
                self._conn.execute(
                    "INSERT INTO batches VALUES (?,?,?,?,?,?,?,?)",
                    (token, judge, None, None, json.dumps(free), "submitting", now, now),
                )
        except BaseException:
            self._conn.execute("ROLLBACK")
            raise
        self._conn.execute("COMMIT")
        return free

    def batch_record(self, token: str) -> dict[str, Any] | None:
        """{batch_id, state} of a submission, or None if it was dropped."""
        row = self._conn.execute("SELECT batch_id, state FROM batches WHERE token = ?", (token,)).fetchone()
        return None if row is None else {"batch_id": row[0], "state": row[1]}

    def batch_submitted(self, token: str, batch_id: str, input_file_id: str | None) -> None:
        self._conn.execute(
            "UPDATE batches SET batch_id = ?, input_file_id = ?, state = 'open', updated_at = ? WHERE token = ?",
            (batch_id, input_file_id, time.time(), token),
        )

    def batch_collected(self, token: str) -> None:
        self._conn.execute(
            "UPDATE batches SET state = 'collected', updated_at = ? WHERE token = ?", (time.time(), token)
        )

    def batch_forget(self, token: str) -> None:
        """Drops a submission that never reached the endpoint (its requests go in a new batch)."""
        self._conn.execute("DELETE FROM batches WHERE token = ?", (token,))

    @_names_a_corrupt_file
    def count(self) -> int:
        return self._conn.execute("SELECT COUNT(*) FROM judgments").fetchone()[0]

    def close(self) -> None:
        self._conn.close()
