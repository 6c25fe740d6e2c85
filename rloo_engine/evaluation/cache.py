"""SQLite judgment cache: one row per judged SlotPair, written the moment the judgment returns.

The key hashes the judge identity (backend, model, template hash, decoding parameters) with the
prompt and both answers in their slots, so the order is part of the key. WAL mode with one commit
per row means a crash loses only the judgments still in flight, and readers (another run, a
progress monitor) never block the writer. The judge's raw replies are stored, so verdicts can be
re-parsed offline. `api_error` judgments are not stored: a rerun should try them again.
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from rloo_engine.evaluation.judges.base import Judgment, SlotPair

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
    created_at REAL NOT NULL
)
"""


def cache_key(identity: dict[str, Any], pair: SlotPair) -> str:
    """SHA-256 of the judge identity and the pair as shown (prompt, slot A answer, slot B answer)."""
    payload = json.dumps(
        {"judge": identity, "prompt": pair.prompt, "answer_a": pair.answer_a, "answer_b": pair.answer_b},
        sort_keys=True,
        ensure_ascii=False,
    )
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()


class JudgmentCache:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # Autocommit (isolation_level=None): each INSERT is its own transaction, durable on return.
        self._conn = sqlite3.connect(self.path, timeout=30.0, isolation_level=None, check_same_thread=False)
        self._conn.execute("PRAGMA journal_mode=WAL")
        # NORMAL is crash-safe for a killed process in WAL mode; only power loss can drop the last commits.
        self._conn.execute("PRAGMA synchronous=NORMAL")
        self._conn.execute(SCHEMA)

    def __enter__(self) -> JudgmentCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def get_many(self, keys: Iterable[str]) -> dict[str, Judgment]:
        keys = list(keys)
        found: dict[str, Judgment] = {}
        for start in range(0, len(keys), 500):
            chunk = keys[start : start + 500]
            rows = self._conn.execute(
                "SELECT key, status, verdict, raw_texts, prompt_tokens, completion_tokens, requests, error "
                f"FROM judgments WHERE key IN ({','.join('?' * len(chunk))})",
                chunk,
            )
            for key, status, verdict, raw, pt, ct, requests, error in rows:
                found[key] = Judgment(status, verdict, json.loads(raw), pt, ct, requests, error)
        return found

    def put(self, key: str, identity: dict[str, Any], template_hash: str | None, pair: SlotPair, j: Judgment) -> None:
        if j.status == "api_error":
            return
        self._conn.execute(
            "INSERT OR REPLACE INTO judgments VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
            (
                key,
                identity["backend"],
                identity.get("model") or identity.get("function"),
                template_hash,
                json.dumps(identity, sort_keys=True),
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
            ),
        )

    def count(self) -> int:
        return self._conn.execute("SELECT COUNT(*) FROM judgments").fetchone()[0]

    def close(self) -> None:
        self._conn.close()
