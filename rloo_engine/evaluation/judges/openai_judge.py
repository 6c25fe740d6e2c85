"""The `openai` judge: any OpenAI-compatible chat-completions endpoint.

Live requests go through `chat_http.ChatHTTPClient`, a thin aiohttp client (why: its docstring; the
client's CPU per request is what limits throughput with 32 requests in flight, see
bench/judge_throughput.py). The Batch API subclass (`openai_batch.py`) talks to Files and Batches
through the official openai client.

Every retry is visible and bounded here: 429, 408/409, 5xx, timeouts and connection errors back off
exponentially with jitter (honouring `Retry-After`) up to `max_attempts`, then the judgment is an
`api_error`. 401, 403, 404 and a 429 whose code is `insufficient_quota` raise `JudgeEndpointError` at
once, since every other request would fail the same way. A refusal (a `refusal` text and no content) is the
judge's answer, not a transient failure: a `parse_error` at once, neither retried nor re-asked; `content: null`
without a refusal text is an empty reply, retried. A semaphore bounds the requests in flight, and an optional
limiter spaces them to a requests-per-minute rate.

`judge.verdict: text` parses the reply's verdict line (one re-ask when it does not parse); `judge.verdict:
logprobs` reads the letters' probabilities at the reply's first token instead (logprob_verdict.py), and stops
the run at the first reply that carries no log-probabilities, since every other reply would lack them too.

The API key lives only inside the clients; messages that might echo it are redacted.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rloo_engine.evaluation.budget import SpendTracker
from rloo_engine.evaluation.config import JudgeConfig
from rloo_engine.evaluation.errors import BudgetExceededError, EvaluationError, JudgeEndpointError, redact
from rloo_engine.evaluation.judges.base import Judge, Judgment, OnJudgment, SlotPair
from rloo_engine.evaluation.judges.chat_http import (
    ChatHTTPClient,
    ConnectFailed,
    ConnectionBroken,
    HTTPStatusFailure,
    RequestTimedOut,
    ResponseTooLarge,
    auth_headers,
    chat_completions_url,
)
from rloo_engine.evaluation.judges.logprob_verdict import (
    first_token_alternatives,
    hard_verdict,
    shown_alternatives,
    slot_a_probability,
)
from rloo_engine.evaluation.parsing import PARSER_VERSION, parse_verdict
from rloo_engine.evaluation.ratelimit import RateLimiter
from rloo_engine.evaluation.retry import FATAL_STATUS, RETRYABLE_STATUS, RetryPolicy, retry_after_seconds
from rloo_engine.evaluation.templates import JudgeTemplate

log = logging.getLogger(__name__)

OPENAI_BASE_URL = "https://api.openai.com/v1"
_WORKERS_PER_SLOT = 4
_FATAL_HINTS = {
    401: "the API key was rejected; check the variable named by judge.api_key_env",
    403: "the key has no access to this model or endpoint",
    404: "no such model or route; check judge.model and judge.base_url (most servers want a URL ending in /v1)",
}
_QUOTA_HINT = (
    "insufficient_quota: the account's quota or credit is used up, and retrying cannot help; add credit or raise "
    "the limit, then rerun (finished judgments are cached)"
)
# verdict logprobs: this many replies without either letter among their first token's alternatives, before any
# reply had one, stop the run (the template or model does not answer with one letter). More than one, so a
# single odd prompt judged first does not stop a run that would have gone well.
_LETTERLESS_REPLIES_LIMIT = 3


@dataclass(frozen=True)
class Reply:
    """A reply that answers: its text (redacted) and the whole chat completion (a logprobs verdict reads it)."""

    text: str
    body: dict[str, Any]


class OpenAIJudge(Judge):
    backend = "openai"

    def __init__(self, cfg: JudgeConfig, template: JudgeTemplate, spend: SpendTracker, api_key: str | None):
        assert cfg.model is not None
        self.model = cfg.model
        self.base_url = cfg.base_url or OPENAI_BASE_URL
        self.template = template
        self.spend = spend
        self.temperature = cfg.temperature
        self.max_tokens = cfg.reply_max_tokens
        self.verdict_mode = cfg.verdict
        self.top_logprobs = cfg.top_logprobs
        self.max_tokens_param = cfg.max_tokens_param
        self.extra_body = dict(cfg.extra_body)
        self.timeout_s = cfg.timeout_s
        self.reask = cfg.reask_on_parse_error
        self.retry = RetryPolicy(cfg.max_attempts, cfg.backoff_initial_s, cfg.backoff_max_s)
        self.max_concurrency = cfg.max_concurrency
        self._semaphore = asyncio.Semaphore(cfg.max_concurrency)
        self._limiter = RateLimiter(cfg.requests_per_minute)
        self._secret = api_key
        # Like the openai client: the account headers come from the environment unless the config names them.
        headers = auth_headers(
            api_key,
            cfg.api_key_header,
            cfg.organization or os.environ.get("OPENAI_ORG_ID"),
            cfg.project or os.environ.get("OPENAI_PROJECT_ID"),
        )
        self._http = ChatHTTPClient(
            chat_completions_url(self.base_url), headers, cfg.timeout_s, cfg.max_concurrency, cfg.max_response_bytes
        )
        # Set by the first budget stop or fatal endpoint error; no request starts after it.
        self._stopped: EvaluationError | None = None
        # Until the endpoint answers once, `connect_failure_limit` failed connections mean it is unreachable.
        self._connect_failure_limit = cfg.connect_failure_limit
        self._connect_failures = 0
        self._reached = False
        self._warned_no_usage = False
        # verdict logprobs: until one reply has a letter among its first token's alternatives, letterless replies count.
        self._letters_seen = False
        self._letterless_replies = 0

    def __repr__(self) -> str:
        return f"OpenAIJudge(model={self.model!r}, base_url={self.base_url!r})"

    @property
    def template_hash(self) -> str:
        return self.template.hash

    def identity(self) -> dict[str, Any]:
        # base_url is left out on purpose: one model served from another host gives the same verdicts.
        identity = {
            "backend": self.backend,
            "model": self.model,
            "template": self.template.hash,
            "temperature": self.temperature,
            "max_tokens": self.max_tokens,
            "extra_body": self.extra_body,
            "reask": self.reask,
        }
        if self.verdict_mode == "logprobs":  # only then: the keys of text verdicts cached before stay valid
            identity.update(verdict="logprobs", top_logprobs=self.top_logprobs)
        return identity

    async def judge(self, pairs: Sequence[SlotPair], on_judgment: OnJudgment | None = None) -> list[Judgment]:
        results: list[Judgment | None] = [None] * len(pairs)
        todo = iter(enumerate(pairs))  # shared by the workers; next() never yields to the loop, so no races

        async def worker() -> None:
            for index, pair in todo:
                if self._stopped is not None:
                    return
                try:
                    judgment = await self._judge_pair(pair)
                except BudgetExceededError as err:
                    self._stopped = self._stopped or err
                    return
                results[index] = judgment
                if on_judgment is not None:
                    on_judgment(index, judgment)

        # More workers than request slots, so pairs waiting out a retry delay (which frees their slot)
        # do not leave slots idle; a bounded number, so a million pairs are not a million tasks.
        workers = min(len(pairs), _WORKERS_PER_SLOT * self.max_concurrency)
        try:
            async with asyncio.TaskGroup() as group:
                for _ in range(workers):
                    group.create_task(worker())
        except BaseExceptionGroup as failed:
            # A fatal endpoint error cancelled the rest; surface it as itself, not as a group.
            raise failed.exceptions[0] from None
        if self._stopped is not None:
            raise self._stopped
        assert all(r is not None for r in results)
        return results  # type: ignore[return-value]

    async def _judge_pair(self, pair: SlotPair) -> Judgment:
        judgment = Judgment(status="ok")
        messages = self.template.render(pair.prompt, pair.answer_a, pair.answer_b, pair.reference)
        reply = await self._complete(messages, judgment)
        if reply is None:
            return judgment
        if self.verdict_mode == "logprobs":
            return self._soft_verdict(judgment, reply)
        return await self._verdict(judgment, messages, reply.text)

    async def _verdict(self, judgment: Judgment, messages: list[dict[str, str]], text: str) -> Judgment:
        """Parses the first reply `text`; re-asks once (live) when it does not parse."""
        judgment.parser_version = PARSER_VERSION
        judgment.raw_texts.append(text)
        verdict = parse_verdict(text, self.template.verdict_prefix)
        if verdict is None and self.reask:
            followup = [
                {"role": "assistant", "content": text},
                {"role": "user", "content": self.template.reask_text},
            ]
            reply = await self._complete(messages + followup, judgment)
            if reply is None:
                return judgment
            judgment.raw_texts.append(reply.text)
            verdict = parse_verdict(reply.text, self.template.verdict_prefix)
        if verdict is None:
            judgment.status = "parse_error"
            judgment.error = f"no final `{self.template.verdict_prefix}: A|B` line in {len(judgment.raw_texts)} replies"
        else:
            judgment.verdict = verdict
        return judgment

    def _soft_verdict(self, judgment: Judgment, reply: Reply) -> Judgment:
        """The verdict of a one-letter reply from its first token's log-probabilities (logprob_verdict.py).

        No log-probabilities at all is the endpoint's doing, and every other reply would lack them too: the
        judgment is an api_error and the run stops. Neither letter among them is this reply's answer: a
        parse_error, which stops the run only while no reply has had a letter."""
        judgment.raw_texts.append(reply.text)
        alternatives = first_token_alternatives(reply.body)
        if alternatives is None:
            judgment.status, judgment.error = "api_error", self._no_logprobs_message()
            self._stopped = self._stopped or JudgeEndpointError(judgment.error)
            return judgment
        p_slot_a = slot_a_probability(alternatives)
        if p_slot_a is None:
            shown = redact(shown_alternatives(alternatives), self._secret)
            judgment.status = "parse_error"
            judgment.error = (
                f"judge endpoint {self.base_url}: neither `A` nor `B` among the {len(alternatives)} alternatives of "
                f"the reply's first token ({shown})"
            )
            self._count_letterless_reply(judgment.error)
            return judgment
        self._letters_seen = True
        judgment.slot_a_probability, judgment.verdict = p_slot_a, hard_verdict(p_slot_a)
        return judgment

    def _no_logprobs_message(self) -> str:
        return (
            f"judge endpoint {self.base_url} returned no log-probabilities for model {self.model!r}: the reply has "
            "no `choices[0].logprobs.content[0].top_logprobs`, which judge.verdict: logprobs reads. Judge with a "
            "model and server that return them for `logprobs: true` (OpenAI reasoning models and some compatible "
            "servers do not), or with judge.verdict: text"
        )

    def _count_letterless_reply(self, error: str) -> None:
        """Stops the run when the first replies all lack both letters: the template or model is not answering A/B."""
        if self._letters_seen:
            return
        self._letterless_replies += 1
        if self._letterless_replies >= _LETTERLESS_REPLIES_LIMIT and self._stopped is None:
            self._stopped = JudgeEndpointError(
                f"the first {self._letterless_replies} replies of model {self.model!r} had no verdict letter to read "
                f"(last: {error}); judge.verdict: logprobs needs a template that makes the judge answer with the "
                f"single letter A or B (judge.template: {self.template.source}; e.g. tldr_letter, helpfulness_letter)"
            )

    def reparse(self, judgment: Judgment) -> bool:
        if self.verdict_mode == "logprobs":
            return False  # a soft verdict is read from log-probabilities, which are not stored: nothing to parse
        if judgment.status != "parse_error" or judgment.parser_version == PARSER_VERSION:
            return False
        judgment.parser_version = PARSER_VERSION
        # The first reply that parses wins, as it would have live (a re-ask is only sent when the first fails).
        prefix = self.template.verdict_prefix
        verdict = next((v for text in judgment.raw_texts if (v := parse_verdict(text, prefix)) is not None), None)
        if verdict is not None:
            judgment.status, judgment.verdict, judgment.error = "ok", verdict, None
        return True

    async def _complete(self, messages: list[dict[str, str]], judgment: Judgment) -> Reply | None:
        """The reply, or None after marking `judgment` as an api_error (or, for a refusal, a parse_error).
        Raises on fatal errors."""
        prompt_chars = sum(len(m["content"]) for m in messages)
        error = ""
        for attempt in range(1, self.retry.max_attempts + 1):
            retry_after = None
            async with self._semaphore:
                await self._limiter.wait()
                if self._stopped is not None:
                    raise self._stopped
                reservation = self.spend.reserve(prompt_chars, self.max_tokens)
                self.spend.requests += 1
                judgment.requests += 1
                try:
                    response = await self._http.post_json(self._body(messages))
                except HTTPStatusFailure as err:
                    self._reached = True
                    status = err.status_code
                    hint = fatal_hint(err)
                    if hint is not None:
                        self._stopped = JudgeEndpointError(self._fatal_message(status, err.message, hint))
                        raise self._stopped from None
                    error = f"HTTP {status}: {redact(err.message, self._secret)[:300]}"
                    if status not in RETRYABLE_STATUS:
                        judgment.status, judgment.error = "api_error", error
                        return None
                    retry_after = retry_after_seconds(err.headers)
                except ResponseTooLarge as err:
                    self._reached = True
                    judgment.status, judgment.error = "api_error", f"{err} (judge.max_response_bytes)"
                    return None
                except RequestTimedOut:
                    error = f"timed out after {self.timeout_s:g}s"
                except ConnectFailed as err:
                    error = f"connection error: {redact(str(err), self._secret)[:300]}"
                    self._count_connect_failure(error)
                except ConnectionBroken as err:
                    self._reached = True
                    error = f"connection error: {redact(str(err), self._secret)[:300]}"
                else:
                    self._reached = True
                    refusal = refusal_text(response)
                    if refusal is not None:
                        self._record_usage(response, prompt_chars, refusal, judgment)  # a refusal is billed too
                        judgment.status = "parse_error"
                        judgment.error = f"the judge refused to answer: {redact(refusal, self._secret)[:300]}"
                        return None
                    # Text from the endpoint is stored (table, cache) and logged: never with the key in it.
                    text = _reply_text(response)
                    if text is not None and self.answers(text, response):
                        text = redact(text, self._secret)
                        self._record_usage(response, prompt_chars, text, judgment)
                        judgment.served_model = served_model(response)
                        return Reply(text, response)
                    if text is None:
                        shown = redact(str(response), self._secret)[:200]
                        error = f"malformed response (not a chat completion): {shown!r}"
                    else:  # an empty reply (content "" or null) is a transient failure a retry fixes, not a verdict
                        error = f"empty reply (finish_reason {_finish_reason(response)!r})"
                finally:
                    self.spend.release(reservation)
            if attempt < self.retry.max_attempts:
                delay = self.retry.delay(attempt, retry_after)
                log.debug("judge request failed (%s); attempt %d, retrying in %.2fs", error, attempt, delay)
                await asyncio.sleep(delay)
        judgment.status = "api_error"
        judgment.error = f"{error} (gave up after {self.retry.max_attempts} attempts)"
        return None

    def answers(self, text: str, response: dict[str, Any]) -> bool:
        """Whether a reply is an answer: text, or for a logprobs verdict the first token's alternatives (a
        whitespace token still carries the letters' probabilities)."""
        if text.strip():
            return True
        return self.verdict_mode == "logprobs" and first_token_alternatives(response) is not None

    def _count_connect_failure(self, error: str) -> None:
        """Stops the run when the endpoint has never answered and the first requests all failed to connect."""
        if self._reached:
            return
        self._connect_failures += 1
        if self._connect_failures >= self._connect_failure_limit:
            self._stopped = JudgeEndpointError(
                f"judge endpoint {self.base_url} is unreachable: the first {self._connect_failures} requests all "
                f"failed to connect (last: {error}); check judge.base_url and that the server is up "
                f"(judge.connect_failure_limit: {self._connect_failure_limit})"
            )
            raise self._stopped

    def _body(self, messages: list[dict[str, str]]) -> dict[str, Any]:
        body = {
            "model": self.model,
            "messages": messages,
            "temperature": self.temperature,
            self.max_tokens_param: self.max_tokens,
            **self.extra_body,
        }
        if self.verdict_mode == "logprobs":
            body.update(logprobs=True, top_logprobs=self.top_logprobs)
        return body

    def _record_usage(self, response: dict[str, Any], prompt_chars: int, text: str, judgment: Judgment) -> None:
        usage = response.get("usage") or {}
        if isinstance(usage, dict) and isinstance(usage.get("prompt_tokens"), int):
            # a non-numeric completion count (seen from compatible servers) is estimated, not a crash
            prompt_tokens = usage["prompt_tokens"]
            completion_tokens = token_count(usage.get("completion_tokens"), math.ceil(len(text) / 4))
        else:
            # Some compatible servers omit usage; estimate (~4 characters per token) so budgets still count.
            if not self._warned_no_usage:
                log.warning("judge endpoint %s returned no token usage; counting estimates", self.base_url)
                self._warned_no_usage = True
            prompt_tokens, completion_tokens = math.ceil(prompt_chars / 4), math.ceil(len(text) / 4)
        self.spend.record(prompt_chars, prompt_tokens, completion_tokens)
        judgment.prompt_tokens += prompt_tokens
        judgment.completion_tokens += completion_tokens

    def _refused_message(self, status: int, detail: str) -> str:
        """The fatal message for a refused status (401/403/404) with its standard hint (the Batch API's calls)."""
        return self._fatal_message(status, detail, _FATAL_HINTS.get(status, "the endpoint refused the call"))

    def _fatal_message(self, status: int, detail: str, hint: str) -> str:
        detail = redact(str(detail), self._secret)[:300]
        return f"judge endpoint {self.base_url} refused model {self.model!r}: HTTP {status}: {detail} ({hint})"

    async def aclose(self) -> None:
        await self._http.aclose()


def fatal_hint(err: HTTPStatusFailure) -> str | None:
    """Why no retry of `err` can succeed, for the error message; None when a retry might."""
    if err.status_code == 429 and err.code == "insufficient_quota":
        return _QUOTA_HINT
    return _FATAL_HINTS[err.status_code] if err.status_code in FATAL_STATUS else None


def refusal_text(response: Any) -> str | None:
    """The `refusal` text of a chat completion that declines to answer; None otherwise.

    A refusal is a non-empty `refusal` with no answer in `content`; asking again at the same temperature gets the
    same answer, so it is not retried. `content: null` without a refusal text says nothing about the judge's
    answer (servers send it for an empty generation too), so it is retried like an empty string reply."""
    try:
        message = response["choices"][0]["message"]
    except (TypeError, KeyError, IndexError):
        return None
    if not isinstance(message, dict):
        return None
    if isinstance(message.get("content"), str) and message["content"].strip():
        return None  # an answer, whatever else the message carries
    refusal = message.get("refusal")
    return refusal if isinstance(refusal, str) and refusal.strip() else None


def served_model(response: Any) -> str | None:
    """The `model` a chat completion says served it: the dated snapshot behind an alias such as `gpt-4o`."""
    model = response.get("model") if isinstance(response, dict) else None
    return model if isinstance(model, str) and model else None


def _reply_text(response: Any) -> str | None:
    """The assistant text of a chat-completion body (an empty reply is ""), or None if it is not one."""
    try:
        content = response["choices"][0]["message"].get("content")
    except (TypeError, KeyError, IndexError, AttributeError):
        return None
    return content if isinstance(content, str) else ""


def _finish_reason(response: Any) -> Any:
    try:
        return response["choices"][0].get("finish_reason")
    except (TypeError, KeyError, IndexError, AttributeError):
        return None


def token_count(reported: Any, estimate: int) -> int:
    """The server's token count when it is one (a positive integer), else `estimate`."""
    if isinstance(reported, int) and not isinstance(reported, bool) and reported > 0:
        return reported
    if isinstance(reported, float) and reported.is_integer() and reported > 0:
        return int(reported)
    return estimate
