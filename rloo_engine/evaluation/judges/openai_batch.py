"""The openai judge through the OpenAI Batch API (`judge.mode: batch`): half price, its own rate limits,
results within the completion window (24 h).

1. Each judge call becomes one line of a JSONL file, `{"custom_id", "method": "POST", "url":
   "/v1/chat/completions", "body"}`; the custom id is a hash of the request body, so the same
   judgment has the same id in every run.
2. Before anything is uploaded, the budget reserves the worst case of every row at batch prices.
3. The submission is recorded in the cache's `batches` table *before* the batch is created (state
   `submitting`, with a token that is also the batch's metadata) and again after (`open`, with the
   batch id). A rerun after a crash or cancel finds the open batch and polls it; a run killed between
   the two writes finds its batch by the metadata token. The same requests are never submitted twice.
4. Polls back off from `batch_poll_initial_s` to `batch_poll_max_s` until the batch ends
   (completed, expired, cancelled or failed), then the output and error files are downloaded and
   mapped back by custom id.
5. Every row is accounted for: a 200 reply is parsed like a live one (a reply that does not parse
   is re-asked once, live); an expired, cancelled or failed row, or one with no result at all, is an
   `api_error` that is not cached, so the next run re-submits it, or, with `batch_unfinished: live`,
   it is judged live at once.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import openai

from rloo_engine.evaluation.budget import SpendTracker
from rloo_engine.evaluation.cache import JudgmentCache
from rloo_engine.evaluation.config import JudgeConfig
from rloo_engine.evaluation.errors import EvaluationError, JudgeEndpointError, redact
from rloo_engine.evaluation.judges.base import Judgment, OnJudgment, SlotPair
from rloo_engine.evaluation.judges.openai_judge import OpenAIJudge, _reply_text, served_model
from rloo_engine.evaluation.retry import FATAL_STATUS, RETRYABLE_STATUS, retry_after_seconds
from rloo_engine.evaluation.templates import JudgeTemplate

log = logging.getLogger(__name__)
T = TypeVar("T")
TERMINAL = frozenset({"completed", "expired", "cancelled", "failed"})
_UNFINISHED = {"batch_expired": "expired", "batch_cancelled": "cancelled"}


def custom_id(body: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True, ensure_ascii=False).encode("utf-8")).hexdigest()[:40]


class OpenAIBatchJudge(OpenAIJudge):
    backend = "openai"

    def __init__(
        self, cfg: JudgeConfig, template: JudgeTemplate, spend: SpendTracker, api_key: str | None, store: JudgmentCache
    ):
        super().__init__(cfg, template, spend, api_key)
        # The official client for the Files and Batches calls (few per batch); its retries off, ours count.
        self._client = openai.AsyncOpenAI(
            base_url=self.base_url,
            api_key=api_key or "EMPTY",
            organization=cfg.organization,  # None: the client reads OPENAI_ORG_ID, as the live path does
            project=cfg.project,
            max_retries=0,
            timeout=cfg.timeout_s,
        )
        self.store = store
        self.poll_initial_s, self.poll_max_s = cfg.batch_poll_initial_s, cfg.batch_poll_max_s
        self.completion_window = cfg.batch_completion_window
        self.max_rows = cfg.batch_max_requests
        self.unfinished = cfg.batch_unfinished
        # Submissions are looked up per judge identity (the mode is not part of it: same verdicts).
        self.judge_key = hashlib.sha256(json.dumps(self.identity(), sort_keys=True).encode()).hexdigest()[:16]
        self.counts: Counter[str] = Counter()
        self.batch_ids: list[str] = []

    def __repr__(self) -> str:
        return f"OpenAIBatchJudge(model={self.model!r}, base_url={self.base_url!r})"

    async def aclose(self) -> None:
        await super().aclose()
        await self._client.close()

    def run_info(self) -> dict[str, Any]:
        return {"mode": "batch", "batch_ids": list(self.batch_ids), "rows": dict(sorted(self.counts.items()))}

    async def judge(self, pairs: Sequence[SlotPair], on_judgment: OnJudgment | None = None) -> list[Judgment]:
        messages = [self.template.render(p.prompt, p.answer_a, p.answer_b) for p in pairs]
        ids = [custom_id(self._body(m)) for m in messages]
        index = {cid: i for i, cid in enumerate(ids)}
        if len(index) != len(ids):
            raise ValueError("OpenAIBatchJudge.judge: the same request twice; pairs must be unique")
        results: list[Judgment | None] = [None] * len(pairs)
        leftovers: list[int] = []

        def done(i: int, judgment: Judgment) -> None:
            if judgment.status == "api_error" and self.unfinished == "live":
                leftovers.append(i)  # judged live below; reported then
                return
            results[i] = judgment
            if on_judgment is not None:
                on_judgment(i, judgment)

        batches = await self._resume(index)
        claimed = {cid for _, _, mine in batches for cid in mine}
        todo = [cid for cid in ids if cid not in claimed]
        for start in range(0, len(todo), self.max_rows):
            chunk = todo[start : start + self.max_rows]
            token, batch_id, reservation = await self._submit(chunk, [messages[index[c]] for c in chunk])
            batches.append((token, batch_id, chunk))
            self.spend.release(reservation)  # the rows' real usage is recorded as they are collected
        for token, batch_id, mine in batches:
            batch = await self._wait(batch_id)
            rows = await self._download(batch)
            for cid in mine:
                i = index[cid]
                row = rows.get(cid)
                if row is None:
                    self.counts["rows_missing"] += 1
                    detail = _batch_errors(batch) or "the batch ended without a result for this row"
                    done(i, Judgment("api_error", requests=1, error=f"batch {batch.id} ({batch.status}): {detail}"))
                else:
                    done(i, await self._judgment_from_row(row, messages[i], batch.id))
            self.store.batch_collected(token)
        if leftovers:
            self.counts["rows_judged_live"] += len(leftovers)
            log.info("batch: judging %d unfinished rows live (batch_unfinished: live)", len(leftovers))
            live = await super().judge([pairs[i] for i in leftovers])
            for i, judgment in zip(leftovers, live, strict=True):
                results[i] = judgment
                if on_judgment is not None:
                    on_judgment(i, judgment)
        assert all(r is not None for r in results)
        return results  # type: ignore[return-value]

    # ------------------------------------------------------------------ submissions
    async def _resume(self, index: dict[str, int]) -> list[tuple[str, str, list[str]]]:
        """(token, batch id, custom ids this call needs) of earlier submissions still to collect."""
        resumed = []
        for sub in self.store.unfinished_batches(self.judge_key):
            batch_id = sub["batch_id"]
            if batch_id is None:  # killed between recording the submission and learning the batch id
                batch_id = await self._find_by_token(sub["token"])
                if batch_id is None:
                    self.store.batch_forget(sub["token"])  # never created: its rows are submitted afresh
                    continue
                self.store.batch_submitted(sub["token"], batch_id, None)
            mine = [c for c in sub["custom_ids"] if c in index]
            if not mine:  # everything it holds is judged already (collected before a crash)
                self.store.batch_collected(sub["token"])
                continue
            log.info("batch %s: resuming (submitted by an earlier run, %d rows needed)", batch_id, len(mine))
            self.counts["batches_resumed"] += 1
            self.counts["rows_resumed"] += len(mine)
            self.batch_ids.append(batch_id)
            resumed.append((sub["token"], batch_id, mine))
        return resumed

    async def _submit(self, chunk: list[str], messages: list[list[dict[str, str]]]) -> tuple[str, str, float]:
        lines = [
            json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/chat/completions", "body": self._body(m)})
            for cid, m in zip(chunk, messages, strict=True)
        ]
        prompt_chars = sum(len(part["content"]) for m in messages for part in m)
        reservation = self.spend.reserve(prompt_chars, self.max_tokens, rows=len(chunk), batch=True)
        token = uuid.uuid4().hex  # new per submission, so an old batch of the same rows is never mistaken for it
        self.store.batch_submitting(token, self.judge_key, chunk)
        data = ("\n".join(lines) + "\n").encode("utf-8")
        file = await self._api(
            lambda: self._client.files.create(file=("judge_batch.jsonl", data, "application/jsonl"), purpose="batch"),
            "uploading the batch file",
        )
        batch = await self._api(
            lambda: self._client.batches.create(
                input_file_id=file.id,
                endpoint="/v1/chat/completions",
                completion_window=self.completion_window,
                metadata={"rloo_token": token},
            ),
            "creating the batch",
        )
        self.store.batch_submitted(token, batch.id, file.id)
        log.info("batch %s: submitted %d requests (file %s)", batch.id, len(chunk), file.id)
        self.counts["batches_submitted"] += 1
        self.counts["rows_submitted"] += len(chunk)
        self.batch_ids.append(batch.id)
        return token, batch.id, reservation

    async def _find_by_token(self, token: str) -> str | None:
        page = await self._api(lambda: self._client.batches.list(limit=100), "listing batches")
        for batch in page.data:
            if (batch.metadata or {}).get("rloo_token") == token:
                return batch.id
        return None

    async def _wait(self, batch_id: str) -> Any:
        delay = self.poll_initial_s
        while True:
            batch = await self._api(lambda: self._client.batches.retrieve(batch_id), f"polling batch {batch_id}")
            if batch.status in TERMINAL:
                log.info("batch %s: %s", batch_id, batch.status)
                return batch
            counts = batch.request_counts
            progress = f"{counts.completed + counts.failed}/{counts.total} rows" if counts else "no counts yet"
            log.info("batch %s: %s (%s); next poll in %.0f s", batch_id, batch.status, progress, delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, self.poll_max_s)

    async def _download(self, batch: Any) -> dict[str, dict[str, Any]]:
        rows: dict[str, dict[str, Any]] = {}
        for file_id in (batch.output_file_id, batch.error_file_id):
            if not file_id:
                continue
            content = await self._api(lambda f=file_id: self._client.files.content(f), f"downloading {file_id}")
            for line in content.text.splitlines():
                if line.strip():
                    row = json.loads(line)
                    rows[row["custom_id"]] = row
        return rows

    # ------------------------------------------------------------------ rows to judgments
    async def _judgment_from_row(self, row: dict[str, Any], messages: list[dict[str, str]], batch_id: str) -> Judgment:
        judgment = Judgment("ok", requests=1)
        response, error = row.get("response"), row.get("error")
        if error or not response:
            code = (error or {}).get("code") or "no_response"
            kind = _UNFINISHED.get(code, "failed")
            self.counts[f"rows_{kind}"] += 1
            message = redact(str((error or {}).get("message", "")), self._secret)[:200]
            judgment.status, judgment.error = "api_error", f"batch {batch_id}: row {kind} ({code}: {message})"
            return judgment
        status, body = response.get("status_code"), response.get("body")
        if status != 200:
            self.counts["rows_failed"] += 1
            detail = body.get("error", body) if isinstance(body, dict) else body
            detail = detail.get("message", detail) if isinstance(detail, dict) else detail
            judgment.status = "api_error"
            judgment.error = f"batch {batch_id}: row failed: HTTP {status}: {redact(str(detail), self._secret)[:200]}"
            return judgment
        text = _reply_text(body)
        if text is None or not text.strip():
            self.counts["rows_failed"] += 1
            what = "empty reply" if text is not None else "malformed response (not a chat completion)"
            judgment.status, judgment.error = "api_error", f"batch {batch_id}: row failed: {what}"
            return judgment
        self.counts["rows_completed"] += 1
        judgment.served_model = served_model(body)
        text = redact(text, self._secret)
        usage = body.get("usage") or {}
        prompt_chars = sum(len(m["content"]) for m in messages)
        pt = int(usage.get("prompt_tokens") or -(-prompt_chars // 4))
        ct = int(usage.get("completion_tokens") or -(-len(text) // 4))
        self.spend.record(prompt_chars, pt, ct, batch=True)
        judgment.prompt_tokens, judgment.completion_tokens = pt, ct
        judgment.batch_prompt_tokens, judgment.batch_completion_tokens = pt, ct
        reasks_before = len(judgment.raw_texts)
        judgment = await self._verdict(judgment, messages, text)
        if len(judgment.raw_texts) > reasks_before + 1:
            self.counts["rows_reasked_live"] += 1
        return judgment

    # ------------------------------------------------------------------ Files / Batches calls
    async def _api(self, call: Callable[[], Awaitable[T]], what: str) -> T:
        """One Files/Batches call with the judge's retry policy; 401/403/404 raise JudgeEndpointError."""
        error = ""
        for attempt in range(1, self.retry.max_attempts + 1):
            retry_after = None
            try:
                return await call()
            except openai.APIStatusError as err:
                if err.status_code in FATAL_STATUS:
                    raise JudgeEndpointError(self._fatal_message(err)) from None
                error = f"HTTP {err.status_code}: {redact(str(err.message), self._secret)[:300]}"
                if err.status_code not in RETRYABLE_STATUS:
                    break
                retry_after = retry_after_seconds(err.response.headers)
            except openai.APIConnectionError as err:  # timeouts included
                error = f"connection error: {redact(str(err), self._secret)[:300]}"
            if attempt < self.retry.max_attempts:
                await asyncio.sleep(self.retry.delay(attempt, retry_after))
        raise EvaluationError(
            f"judge batch: {what} at {self.base_url} failed: {error}; submissions are recorded in the cache, so a "
            "rerun resumes them"
        )


def _batch_errors(batch: Any) -> str:
    errors = getattr(batch, "errors", None)
    data = getattr(errors, "data", None) or []
    return "; ".join(f"{e.code}: {e.message}" for e in data if e is not None)
