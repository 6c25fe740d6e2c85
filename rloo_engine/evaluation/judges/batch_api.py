"""The Files and Batches calls of the Batch API judge: the official openai client with the judge's retry
policy, a refused call (401/403/404) as a JudgeEndpointError, and every server text redacted."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import openai

from rloo_engine.evaluation.errors import EvaluationError, JudgeEndpointError, redact
from rloo_engine.evaluation.judges.batch_files import BatchResults
from rloo_engine.evaluation.retry import FATAL_STATUS, RETRYABLE_STATUS, RetryPolicy, retry_after_seconds

log = logging.getLogger(__name__)
T = TypeVar("T")
TERMINAL = frozenset({"completed", "expired", "cancelled", "failed"})
_CLOCK_SKEW_S = 3600.0  # how far OpenAI's clock (a batch's created_at) may be behind ours, with room to spare


class BatchAPIClient:
    def __init__(
        self,
        base_url: str,
        api_key: str | None,
        timeout_s: float,
        retry: RetryPolicy,
        poll_s: tuple[float, float],
        refused_message: Callable[[int, str], str],
        organization: str | None = None,
        project: str | None = None,
    ):
        # Its own retries off: ours count, and back off like the live requests'. organization/project None:
        # the client reads OPENAI_ORG_ID / OPENAI_PROJECT_ID, as the live path does.
        self._client = openai.AsyncOpenAI(
            base_url=base_url, api_key=api_key or "EMPTY", organization=organization, project=project,
            max_retries=0, timeout=timeout_s,
        )
        self.base_url = base_url
        self._secret = api_key
        self.retry = retry
        self.poll_initial_s, self.poll_max_s = poll_s
        self._refused_message = refused_message  # (HTTP status, redacted detail) -> what went wrong and what to do

    async def close(self) -> None:
        await self._client.close()

    async def upload(self, data: bytes) -> str:
        file = await self._call(
            lambda: self._client.files.create(file=("judge_batch.jsonl", data, "application/jsonl"), purpose="batch"),
            "uploading the batch file",
        )
        return file.id

    async def create(self, input_file_id: str, completion_window: Any, token: str) -> str:
        batch = await self._call(
            lambda: self._client.batches.create(
                input_file_id=input_file_id,
                endpoint="/v1/chat/completions",
                completion_window=completion_window,
                metadata={"rloo_token": token},
            ),
            "creating the batch",
        )
        return batch.id

    async def find_by_token(self, token: str, recorded_at: float) -> str | None:
        """The id of the batch created with metadata `token`, or None. The account's batches are read newest
        first, page after page, down to those older than the submission's record (by more than any clock skew):
        one of those cannot be it."""
        oldest = recorded_at - _CLOCK_SKEW_S
        page = await self._call(lambda: self._client.batches.list(limit=100), "listing batches")
        while True:
            for batch in page.data:
                if (batch.metadata or {}).get("rloo_token") == token:
                    return batch.id
                if batch.created_at < oldest:
                    return None
            if not page.has_next_page():
                return None
            page = await self._call(page.get_next_page, "listing batches")

    async def wait(self, batch_id: str) -> Any:
        """The batch once it has ended; polls back off from `poll_initial_s` to `poll_max_s`."""
        delay = self.poll_initial_s
        while True:
            batch = await self._call(lambda: self._client.batches.retrieve(batch_id), f"polling batch {batch_id}")
            if batch.status in TERMINAL:
                log.info("batch %s: %s", batch_id, batch.status)
                return batch
            counts = batch.request_counts
            progress = f"{counts.completed + counts.failed}/{counts.total} rows" if counts else "no counts yet"
            log.info("batch %s: %s (%s); next poll in %.0f s", batch_id, batch.status, progress, delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, self.poll_max_s)

    async def download(self, batch: Any) -> BatchResults:
        """The result lines of the batch's output and error files, redacted."""
        results = BatchResults()
        for file_id in (batch.output_file_id, batch.error_file_id):
            if file_id:
                content = await self._call(lambda f=file_id: self._client.files.content(f), f"downloading {file_id}")
                results.add_file(redact(content.text, self._secret))
        return results

    def batch_errors(self, batch: Any) -> str:
        """The batch-level errors (e.g. a file that failed validation) as one redacted line; "" if none."""
        data = getattr(getattr(batch, "errors", None), "data", None) or []
        return redact("; ".join(f"{e.code}: {e.message}" for e in data if e is not None), self._secret)[:300]

    async def _call(self, call: Callable[[], Awaitable[T]], what: str) -> T:
        """One Files/Batches call with the judge's retry policy; 401/403/404 raise JudgeEndpointError."""
        error, refused = "", None
        for attempt in range(1, self.retry.max_attempts + 1):
            retry_after = None
            try:
                return await call()
            except openai.APIStatusError as err:
                if err.status_code in FATAL_STATUS:
                    refused = self._refused(what, err.status_code, str(err.message))
                    break  # raised below, outside `except`: the client's error (it quotes the body) is not chained
                error = f"HTTP {err.status_code}: {redact(str(err.message), self._secret)[:300]}"
                if err.status_code not in RETRYABLE_STATUS:
                    break
                retry_after = retry_after_seconds(err.response.headers)
            except openai.APIConnectionError as err:  # timeouts included
                error = f"connection error: {redact(str(err), self._secret)[:300]}"
            if attempt < self.retry.max_attempts:
                await asyncio.sleep(self.retry.delay(attempt, retry_after))
        if refused is not None:
            raise JudgeEndpointError(refused)
        raise EvaluationError(
            f"judge batch: {what} at {self.base_url} failed: {error}; submissions are recorded in the cache, so a "
            "rerun resumes them"
        )

    def _refused(self, what: str, status: int, detail: str) -> str:
        message = f"judge batch: {what} was refused: {self._refused_message(status, redact(detail, self._secret))}"
        if status == 404:
            message += (
                "; a server without the Batch API (e.g. `vllm serve`) answers 404 on /v1/files and /v1/batches: "
                "use judge.mode: live"
            )
        return message
