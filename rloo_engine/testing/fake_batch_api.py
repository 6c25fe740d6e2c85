"""The OpenAI Files and Batches endpoints of the fake server, for testing `judge.mode: batch` offline.

Speaks what the official client sends: `POST /v1/files` (multipart, purpose `batch`),
`GET /v1/files/{id}/content`, `POST /v1/batches`, `GET /v1/batches/{id}`, `GET /v1/batches`
(with `metadata`; paginated like OpenAI's: newest first, `limit` (default 20, at most 100), `after`,
`has_more`) and `POST /v1/batches/{id}/cancel`. A batch stays `in_progress` for
`polls_to_finish` retrieves (or while `hold` is set), then answers every row with the `reply` callable it
was given (the server passes its chat behaviour): 200 replies go to the output file, others to the error
file. Failure modes, each off by default:

- `expire_after_rows=k` finishes only the first k rows and ends the batch `expired`, the rest in the
  error file as `batch_expired` (a partial expiry, as OpenAI reports it);
- `refuse_status=404` answers every Files and Batches request with that status, as a server without
  the Batch API does (`vllm serve`); its body echoes the caller's key, to test redaction;
- `corrupt_output_rows=k` cuts the first k lines of each output file in half (a line that is not JSON);
- `fail_batches_with=(code, message)` ends every batch `failed` with that batch-level error and no files;
- `upload_delay_s` answers each upload that much later (a large file on a slow link), without holding up
  the other requests; `uploads_started` counts uploads as they arrive.

Everything is counted for the tests.
"""

from __future__ import annotations

import itertools
import json
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs

# A chat-completions request body -> (HTTP status, response body), as the live endpoint would answer it.
ReplyFn = Callable[[dict[str, Any]], tuple[int, Any]]

_ids = itertools.count(1)


@dataclass
class FakeBatch:
    id: str
    input_file_id: str
    metadata: dict[str, str]
    rows: list[dict[str, Any]]
    status: str = "validating"
    polls: int = 0
    output_file_id: str | None = None
    error_file_id: str | None = None
    errors: list[dict[str, Any]] | None = None  # batch-level errors (a batch that failed validation)
    created_at: int = field(default_factory=lambda: int(time.time()))

    def to_json(self) -> dict[str, Any]:
        done = self.status in ("completed", "expired", "cancelled", "failed")
        return {
            "id": self.id,
            "object": "batch",
            "endpoint": "/v1/chat/completions",
            "input_file_id": self.input_file_id,
            "completion_window": "24h",
            "status": self.status,
            "output_file_id": self.output_file_id,
            "error_file_id": self.error_file_id,
            "created_at": self.created_at,
            "metadata": self.metadata,
            "errors": {"object": "list", "data": self.errors} if self.errors else None,
            "request_counts": {"total": len(self.rows), "completed": 0, "failed": 0} if not done else None,
        }


class FakeBatchAPI:
    def __init__(self, reply: ReplyFn, polls_to_finish: int = 2, expire_after_rows: int | None = None):
        self.reply = reply
        self.polls_to_finish = polls_to_finish
        self.expire_after_rows = expire_after_rows
        self.hold = False  # while True, batches stay in_progress however often they are polled
        self.refuse_status: int | None = None
        self.corrupt_output_rows = 0
        self.fail_batches_with: tuple[str, str] | None = None
        self.upload_delay_s = 0.0
        self.uploads_started = 0
        self.files: dict[str, bytes] = {}
        self.uploads: list[str] = []  # ids of files uploaded with purpose "batch"
        self.batches: dict[str, FakeBatch] = {}
        self.retrieves = 0
        self.calls: list[tuple[str, str]] = []  # (method, path) of every Files/Batches request
        self._lock = threading.Lock()

    def handles(self, path: str) -> bool:
        return re.match(r"^(/v1)?/(files|batches)", path) is not None

    def delay_s(self, method: str, path: str) -> float:
        """How long the server waits (asynchronously) before answering this request; called as it arrives."""
        if method == "POST" and path.partition("?")[0].removeprefix("/v1") == "/files":
            with self._lock:
                self.uploads_started += 1
            return self.upload_delay_s
        return 0.0

    @property
    def batches_created(self) -> int:
        with self._lock:
            return len(self.batches)

    def respond(self, method: str, path: str, raw: bytes, headers: dict[str, str]) -> tuple[int, Any, dict[str, str]]:
        path, _, query = path.partition("?")
        path = path.removeprefix("/v1")
        with self._lock:
            self.calls.append((method, path))
            if self.refuse_status is not None:
                key = headers.get("authorization", "").removeprefix("Bearer ")
                message = f"Not Found: {method} /v1{path} (Authorization: Bearer {key})"
                return self.refuse_status, {"error": {"message": message, "type": "invalid_request_error"}}, {}
            if method == "POST" and path == "/files":
                return self._upload(raw, headers.get("content-type", ""))
            if method == "GET" and (m := re.fullmatch(r"/files/([^/]+)/content", path)):
                if m.group(1) not in self.files:
                    return 404, {"error": {"message": f"no file {m.group(1)}"}}, {}
                return 200, self.files[m.group(1)], {}
            if method == "POST" and path == "/batches":
                return self._create(json.loads(raw))
            if method == "GET" and path == "/batches":
                return self._list(parse_qs(query))
            if m := re.fullmatch(r"/batches/([^/]+)(/cancel)?", path):
                batch = self.batches.get(m.group(1))
                if batch is None:
                    return 404, {"error": {"message": f"no batch {m.group(1)}"}}, {}
                if m.group(2):
                    batch.status = "cancelled" if batch.status not in ("completed", "expired") else batch.status
                    self._finish(batch, len(batch.rows) if batch.status != "cancelled" else 0, "batch_cancelled")
                else:
                    self.retrieves += 1
                    self._advance(batch)
                return 200, batch.to_json(), {}
        return 404, {"error": {"message": f"no route {method} {path}"}}, {}

    def add_finished_batch(self, metadata: dict[str, str] | None = None) -> str:
        """A completed batch of no rows, as another job on the same account leaves them; its id."""
        with self._lock:
            batch = FakeBatch(f"batch_{next(_ids)}", "file-none", dict(metadata or {}), [], status="completed")
            self.batches[batch.id] = batch
            return batch.id

    def _list(self, params: dict[str, list[str]]) -> tuple[int, Any, dict[str, str]]:
        newest_first = list(reversed(self.batches.values()))
        limit = min(int(params.get("limit", ["20"])[0]), 100)
        start = 0
        if "after" in params:
            ids = [b.id for b in newest_first]
            if params["after"][0] not in ids:
                return 400, {"error": {"message": f"no batch {params['after'][0]} to list after"}}, {}
            start = ids.index(params["after"][0]) + 1
        page = newest_first[start : start + limit]
        body = {
            "object": "list",
            "data": [b.to_json() for b in page],
            "first_id": page[0].id if page else None,
            "last_id": page[-1].id if page else None,
            "has_more": start + limit < len(newest_first),
        }
        return 200, body, {}

    def _upload(self, raw: bytes, content_type: str) -> tuple[int, Any, dict[str, str]]:
        boundary = re.search(r"boundary=\"?([^\";]+)", content_type)
        if boundary is None:
            return 400, {"error": {"message": "expected multipart/form-data"}}, {}
        content, purpose = None, None
        for part in raw.split(b"--" + boundary.group(1).encode()):
            head, _, body = part.partition(b"\r\n\r\n")
            body = body.removesuffix(b"\r\n")
            if b'name="file"' in head:
                content = body
            elif b'name="purpose"' in head:
                purpose = body.decode()
        if content is None or purpose != "batch":
            return 400, {"error": {"message": f"expected a file with purpose batch (got {purpose!r})"}}, {}
        file_id = f"file-{next(_ids)}"
        self.files[file_id] = content
        self.uploads.append(file_id)
        return 200, {"id": file_id, "object": "file", "bytes": len(content), "purpose": "batch"}, {}

    def _create(self, body: dict[str, Any]) -> tuple[int, Any, dict[str, str]]:
        file_id = body.get("input_file_id")
        if file_id not in self.files or body.get("endpoint") != "/v1/chat/completions":
            message = f"bad input_file_id {file_id!r} or endpoint {body.get('endpoint')!r}"
            return 400, {"error": {"message": message}}, {}
        rows = [json.loads(line) for line in self.files[file_id].decode().splitlines() if line.strip()]
        batch = FakeBatch(f"batch_{next(_ids)}", file_id, dict(body.get("metadata") or {}), rows)
        self.batches[batch.id] = batch
        return 200, batch.to_json(), {}

    def _advance(self, batch: FakeBatch) -> None:
        if batch.status in ("completed", "expired", "cancelled", "failed"):
            return
        batch.polls += 1
        if self.hold or batch.polls < self.polls_to_finish:
            batch.status = "in_progress"
            return
        if self.fail_batches_with is not None:
            code, message = self.fail_batches_with
            batch.status = "failed"
            batch.errors = [{"code": code, "message": message, "param": None, "line": None}]
        elif self.expire_after_rows is not None and self.expire_after_rows < len(batch.rows):
            batch.status = "expired"
            self._finish(batch, self.expire_after_rows, "batch_expired")
        else:
            batch.status = "completed"
            self._finish(batch, len(batch.rows), "")

    def _finish(self, batch: FakeBatch, n_done: int, unfinished_code: str) -> None:
        outputs, errors = [], []
        for i, row in enumerate(batch.rows):
            if i >= n_done:
                message = "This request could not be executed before the completion window expired."
                errors.append(
                    {
                        "id": f"batch_req_{i}",
                        "custom_id": row["custom_id"],
                        "response": None,
                        "error": {"code": unfinished_code, "message": message},
                    }
                )
                continue
            status, payload = self.reply(row["body"])
            result = {
                "id": f"batch_req_{i}",
                "custom_id": row["custom_id"],
                "response": {"status_code": status, "request_id": f"req_{i}", "body": payload},
                "error": None,
            }
            (outputs if status == 200 else errors).append(result)
        for rows, attr in ((outputs, "output_file_id"), (errors, "error_file_id")):
            if rows:
                lines = [json.dumps(r) for r in rows]
                if attr == "output_file_id":
                    cut = min(self.corrupt_output_rows, len(lines))
                    lines[:cut] = [line[: len(line) // 2] for line in lines[:cut]]
                file_id = f"file-{next(_ids)}"
                self.files[file_id] = "".join(line + "\n" for line in lines).encode()
                setattr(batch, attr, file_id)
