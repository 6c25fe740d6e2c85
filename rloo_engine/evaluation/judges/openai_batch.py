"""The openai judge through the OpenAI Batch API (`judge.mode: batch`): half price, its own rate limits,
results within the completion window (24 h).

1. Each judge call becomes one line of a JSONL file (batch_files.py); the lines are cut into files of
   at most `batch_max_requests` lines and `batch_max_bytes` bytes.
2. Before a file is uploaded, the budget reserves the worst case of its rows at batch prices, and keeps
   it until the batch's results are downloaded. The batches that fit are submitted and collected, then
   the next ones (rounds); when nothing is in flight and the next batch does not fit, the run stops.
3. A submission claims its requests in the cache's `batches` table *before* the batch is created
   (state `submitting`, with a token that is also the batch's metadata; one transaction, so two runs
   sharing the cache never claim one request) and is recorded again after (`open`, with the batch id).
   A rerun after a crash or cancel finds the open batch and polls it. A `submitting` record whose run
   is alive (its lock is held, submission_locks.py) is waited for; one whose run died is looked up by
   its token. The same requests are never submitted twice.
4. Polls back off from `batch_poll_initial_s` to `batch_poll_max_s` until the batch ends
   (completed, expired, cancelled or failed), then the output and error files are downloaded and
   mapped back by custom id (batch_api.py).
5. Every row is accounted for: a 200 reply is read like a live one (a reply that does not parse
   is re-asked once, live; a refusal is a parse_error; rows of a logprobs verdict without
   log-probabilities stop the run once their batch is collected); an expired, cancelled or failed row,
   a malformed line, or a row with no result at all, is an `api_error` that is not cached, so the next
   run re-submits it, or, with `batch_unfinished: live`, it is judged live at once.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import math
import time
import uuid
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rloo_engine.evaluation.budget import SpendTracker
from rloo_engine.evaluation.cache import JudgmentCache
from rloo_engine.evaluation.config import JudgeConfig
from rloo_engine.evaluation.errors import BudgetExceededError, ConfigError, redact
from rloo_engine.evaluation.judges.base import Judgment, OnJudgment, SlotPair
from rloo_engine.evaluation.judges.batch_api import BatchAPIClient
from rloo_engine.evaluation.judges.batch_files import BatchResults, custom_id, request_line, split_into_files
from rloo_engine.evaluation.judges.openai_judge import (
    OpenAIJudge,
    Reply,
    _reply_text,
    refusal_text,
    served_model,
    token_count,
)
from rloo_engine.evaluation.submission_locks import SubmissionLocks
from rloo_engine.evaluation.templates import JudgeTemplate

log = logging.getLogger(__name__)
_UNFINISHED = {"batch_expired": "expired", "batch_cancelled": "cancelled"}


@dataclass
class Requests:
    """The requests of one `judge` call: chat messages and request lines, by position and by custom id."""

    messages: list[list[dict[str, str]]]
    lines: list[bytes]
    index: dict[str, int]

    def prompt_chars(self, ids: Sequence[str]) -> int:
        return sum(len(part["content"]) for c in ids for part in self.messages[self.index[c]])


@dataclass
class Submission:
    """A batch this call collects: its cache token, its id, the custom ids it holds that this call needs, and
    the budget reserved for them until their real cost is known."""

    token: str
    batch_id: str
    custom_ids: list[str]
    reservation: float


class OpenAIBatchJudge(OpenAIJudge):
    backend = "openai"

    def __init__(
        self, cfg: JudgeConfig, template: JudgeTemplate, spend: SpendTracker, api_key: str | None, store: JudgmentCache
    ):
        super().__init__(cfg, template, spend, api_key)
        poll_s = (cfg.batch_poll_initial_s, cfg.batch_poll_max_s)
        self.api = BatchAPIClient(self.base_url, api_key, cfg.timeout_s, self.retry, poll_s, self._refused_message,
                                  organization=cfg.organization, project=cfg.project)
        self.store = store
        self.locks = SubmissionLocks(store.path)
        self._lock_poll_s = min(cfg.batch_poll_initial_s, 1.0)
        self.completion_window = cfg.batch_completion_window
        self.max_rows, self.max_bytes = cfg.batch_max_requests, cfg.batch_max_bytes
        self.unfinished = cfg.batch_unfinished
        # Submissions are looked up per judge identity (the mode is not part of it: same verdicts).
        self.judge_key = hashlib.sha256(json.dumps(self.identity(), sort_keys=True).encode()).hexdigest()[:16]
        self.counts: Counter[str] = Counter()
        self.batch_ids: list[str] = []

    def __repr__(self) -> str:
        return f"OpenAIBatchJudge(model={self.model!r}, base_url={self.base_url!r})"

    async def aclose(self) -> None:
        await super().aclose()
        await self.api.close()

    def run_info(self) -> dict[str, Any]:
        return {"mode": "batch", "batch_ids": list(self.batch_ids), "rows": dict(sorted(self.counts.items()))}

    async def judge(self, pairs: Sequence[SlotPair], on_judgment: OnJudgment | None = None) -> list[Judgment]:
        reqs = self._requests(pairs)
        results: list[Judgment | None] = [None] * len(pairs)
        leftovers: list[int] = []

        def done(i: int, judgment: Judgment) -> None:
            if judgment.status == "api_error" and self.unfinished == "live":
                leftovers.append(i)  # judged live below; reported then
                return
            results[i] = judgment
            if on_judgment is not None:
                on_judgment(i, judgment)

        # A batch another run collects from now on holds results this call lacks (the runner read the judgment
        # cache a moment ago): it is read again, not submitted again. Not earlier: an earlier run's batch whose
        # rows expired is collected, and those rows are to be submitted afresh.
        started = time.time()
        remaining = dict.fromkeys(reqs.index)  # custom ids with no judgment yet, in order
        # Rounds: resume what earlier or other runs submitted, submit the rest as far as the budget allows, collect
        # it all (real costs replace worst cases), and again with what is left. Usually a single round.
        while remaining:
            pending = await self._resume(remaining, reqs, started)
            held = {cid for sub in pending for cid in sub.custom_ids}
            free = [cid for cid in remaining if cid not in held]
            budget_stop = await self._submit_while_budget_allows(free, reqs, pending, started)
            if not pending:
                if budget_stop is not None:
                    raise budget_stop
                continue  # another run claimed them since `_resume` looked: the next round finds its batch
            if budget_stop is not None:
                log.info("batch: the other requests wait for the budget until these %d batches end", len(pending))
            for sub in pending:
                await self._collect(sub, reqs, done)
                for cid in sub.custom_ids:
                    remaining.pop(cid, None)
            if self._stopped is not None:  # rows every other request would repeat (no logprobs): no further round
                raise self._stopped
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

    def _requests(self, pairs: Sequence[SlotPair]) -> Requests:
        messages = [self.template.render(p.prompt, p.answer_a, p.answer_b, p.reference) for p in pairs]
        ids = [custom_id(self._body(m)) for m in messages]
        index = {cid: i for i, cid in enumerate(ids)}
        if len(index) != len(ids):
            raise ValueError("OpenAIBatchJudge.judge: the same request twice; pairs must be unique")
        lines = [request_line(cid, self._body(m)) for cid, m in zip(ids, messages, strict=True)]
        largest = max(map(len, lines), default=0)
        if largest > self.max_bytes:  # refused before anything is uploaded
            raise ConfigError(
                f"judge.batch_max_bytes: {self.max_bytes}; the request of one judgment is {largest} bytes, and a "
                "batch file must hold at least one. Raise batch_max_bytes (OpenAI accepts files up to 200 MB) or "
                "shorten the prompts (or judge with mode: live)"
            )
        return Requests(messages, lines, index)

    async def _collect(self, sub: Submission, reqs: Requests, done: OnJudgment) -> None:
        """Waits for `sub`'s batch to end and turns each of its rows into a judgment."""
        batch = await self.api.wait(sub.batch_id)
        files = await self.api.download(batch)
        self.spend.release(sub.reservation)  # its real cost is in the files: each row's usage is recorded below
        for cid in sub.custom_ids:
            i = reqs.index[cid]
            row = files.rows.get(cid)
            if row is not None:
                done(i, await self._judgment_from_row(row, reqs.messages[i], batch.id))
            elif cid in files.malformed:
                self.counts["rows_malformed"] += 1
                error = f"batch {batch.id}: malformed line in the output file: {files.malformed[cid]}"
                done(i, Judgment("api_error", requests=1, error=error))
            else:
                self.counts["rows_missing"] += 1
                done(i, Judgment("api_error", requests=1, error=self._missing_row_error(batch, files)))
        self.store.batch_collected(sub.token)

    def _missing_row_error(self, batch: Any, files: BatchResults) -> str:
        detail = self.api.batch_errors(batch) or "the batch ended without a result for this row"
        if files.unreadable_lines:
            detail += f" ({files.unreadable_lines} lines of its files could not be read)"
        return f"batch {batch.id} ({batch.status}): {detail}"

    # ------------------------------------------------------------------ submissions
    async def _resume(self, remaining: dict[str, None], reqs: Requests, started: float) -> list[Submission]:
        """Submissions of earlier or other runs holding requests this call still needs, each held against the
        budget (it is billed whatever this run decides)."""
        resumed: list[Submission] = []
        taken: set[str] = set()
        for sub in self.store.unfinished_batches(self.judge_key, collected_since=started):
            mine = [c for c in sub["custom_ids"] if c in remaining and c not in taken]
            if not mine:
                continue  # nothing this call needs: left as it is for the run that does
            batch_id = sub["batch_id"] or await self._created_batch_id(sub)
            if batch_id is None:
                continue  # never created: its requests are claimed afresh
            taken.update(mine)
            log.info("batch %s: resuming (submitted by an earlier or other run, %d rows needed)", batch_id, len(mine))
            self.counts["batches_resumed"] += 1
            self.counts["rows_resumed"] += len(mine)
            self.batch_ids.append(batch_id)
            reservation = self.spend.hold(reqs.prompt_chars(mine), self.max_tokens, rows=len(mine), batch=True)
            resumed.append(Submission(sub["token"], batch_id, mine, reservation))
        return resumed

    async def _created_batch_id(self, sub: dict[str, Any]) -> str | None:
        """The batch id of a submission recorded as `submitting`. While the run making it is alive, waits for it
        to record the id; if that run died first, looks the batch up by its token. None: never created (the
        record is dropped)."""
        token = sub["token"]
        if self.locks.is_held(token):
            log.info("batch: another run is submitting %d of these requests; waiting for it", len(sub["custom_ids"]))
            while self.locks.is_held(token):
                await asyncio.sleep(self._lock_poll_s)
        record = self.store.batch_record(token)  # read again: the submitter may have finished meanwhile
        if record is None or record["batch_id"] is not None:
            return None if record is None else record["batch_id"]
        batch_id = await self.api.find_by_token(token, sub["created_at"])
        if batch_id is None:
            self.store.batch_forget(token)
        else:
            self.store.batch_submitted(token, batch_id, None)
        self.locks.discard(token)
        return batch_id

    async def _submit_while_budget_allows(
        self, free: list[str], reqs: Requests, pending: list[Submission], started: float
    ) -> BudgetExceededError | None:
        """Submits `free` in files of at most `max_rows` lines and `max_bytes` bytes, onto `pending`, until one
        does not fit the budget (returned)."""
        for file in split_into_files([len(reqs.lines[reqs.index[c]]) for c in free], self.max_rows, self.max_bytes):
            try:
                sub = await self._submit([free[k] for k in file], reqs, started)
            except BudgetExceededError as err:
                return err
            if sub is not None:
                pending.append(sub)
        return None

    async def _submit(self, chunk: list[str], reqs: Requests, started: float) -> Submission | None:
        """Claims `chunk` and submits what no other submission holds as one batch; None if that is nothing."""
        reservation = self.spend.reserve(reqs.prompt_chars(chunk), self.max_tokens, rows=len(chunk), batch=True)
        token = uuid.uuid4().hex  # new per submission, so an old batch of the same rows is never mistaken for it
        with self.locks.held(token):
            mine = self.store.batch_claim(token, self.judge_key, chunk, collected_since=started)
            if not mine:  # another run claimed all of them since this round began
                self.spend.release(reservation)
                return None
            file_id = await self.api.upload(b"".join(reqs.lines[reqs.index[c]] for c in mine))
            batch_id = await self.api.create(file_id, self.completion_window, token)
            self.store.batch_submitted(token, batch_id, file_id)
        log.info("batch %s: submitted %d requests (file %s)", batch_id, len(mine), file_id)
        self.counts["batches_submitted"] += 1
        self.counts["rows_submitted"] += len(mine)
        self.batch_ids.append(batch_id)
        return Submission(token, batch_id, mine, reservation)

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
        refusal = refusal_text(body)
        if refusal is not None:  # the judge's answer, as live: a parse_error, not re-submitted
            self.counts["rows_refused"] += 1
            self._record_row_usage(body, messages, refusal, judgment)
            judgment.status = "parse_error"
            judgment.error = f"batch {batch_id}: the judge refused to answer: {redact(refusal, self._secret)[:300]}"
            return judgment
        text = _reply_text(body)
        if text is None or not self.answers(text, body):
            self.counts["rows_failed"] += 1
            what = "empty reply" if text is not None else "malformed response (not a chat completion)"
            judgment.status, judgment.error = "api_error", f"batch {batch_id}: row failed: {what}"
            return judgment
        self.counts["rows_completed"] += 1
        judgment.served_model = served_model(body)
        text = redact(text, self._secret)
        self._record_row_usage(body, messages, text, judgment)
        if self.verdict_mode == "logprobs":
            return self._soft_verdict(judgment, Reply(text, body))
        reasks_before = len(judgment.raw_texts)
        judgment = await self._verdict(judgment, messages, text)
        if len(judgment.raw_texts) > reasks_before + 1:
            self.counts["rows_reasked_live"] += 1
        return judgment

    def _record_row_usage(self, body: dict[str, Any], messages: list[dict[str, str]], text: str,
                          judgment: Judgment) -> None:
        """A row's tokens, billed at batch prices."""
        usage = body.get("usage") if isinstance(body.get("usage"), dict) else {}
        prompt_chars = sum(len(m["content"]) for m in messages)
        # Some compatible servers omit usage or fill it oddly; estimate (~4 characters per token) so budgets count.
        pt = token_count(usage.get("prompt_tokens"), math.ceil(prompt_chars / 4))
        ct = token_count(usage.get("completion_tokens"), math.ceil(len(text) / 4))
        self.spend.record(prompt_chars, pt, ct, batch=True)
        judgment.prompt_tokens, judgment.completion_tokens = pt, ct
        judgment.batch_prompt_tokens, judgment.batch_completion_tokens = pt, ct
