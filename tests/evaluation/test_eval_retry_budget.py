"""Retry timing, Retry-After parsing, the budget guard and reading chat-completion bodies."""

from __future__ import annotations

import email.utils
import random

import pytest

from rloo_engine.evaluation import BudgetExceededError
from rloo_engine.evaluation.budget import Price, SpendTracker
from rloo_engine.evaluation.judges.openai_judge import _reply_text
from rloo_engine.evaluation.retry import RetryPolicy, retry_after_seconds


def test_backoff_doubles_with_jitter_and_is_capped():
    policy = RetryPolicy(max_attempts=8, initial_s=1.0, max_s=10.0)
    rng = random.Random(0)
    for attempt, ceiling in [(1, 1.0), (2, 2.0), (3, 4.0), (4, 8.0), (5, 10.0), (8, 10.0)]:
        delays = [policy.delay(attempt, rng=rng) for _ in range(200)]
        assert all(ceiling / 2 <= d <= ceiling for d in delays)
        assert max(delays) - min(delays) > ceiling / 4  # jittered, not a fixed delay


def test_retry_after_wins_over_backoff_but_is_capped():
    policy = RetryPolicy(initial_s=1.0, max_s=30.0)
    assert policy.delay(1, retry_after_s=7.0) == 7.0
    assert policy.delay(1, retry_after_s=3600.0) == 30.0


def test_retry_after_header_forms():
    assert retry_after_seconds({"retry-after": "2"}) == 2.0
    assert retry_after_seconds({"retry-after": "0.25"}) == 0.25
    assert retry_after_seconds({"retry-after-ms": "1500", "retry-after": "9"}) == 1.5
    date = email.utils.formatdate(1_000_030.0, usegmt=True)
    assert retry_after_seconds({"retry-after": date}, now=1_000_000.0) == pytest.approx(30.0)
    assert retry_after_seconds({"retry-after": "soon"}) is None
    assert retry_after_seconds({}) is None


def test_budget_guard_reserves_the_worst_case_of_calls_in_flight():
    spend = SpendTracker(Price(1000.0, 1000.0), budget_usd=1.0, model="m")  # $0.001 per token
    first = spend.reserve(prompt_chars=400, max_completion_tokens=100)  # 400 * 0.5 + 16 + 100 tokens
    assert first == pytest.approx(0.316)
    spend.reserve(400, 100)
    spend.reserve(400, 100)
    with pytest.raises(BudgetExceededError, match="budget_usd"):
        spend.reserve(400, 100)  # 4 x 0.316 > 1.0 although nothing has been spent yet
    spend.release(first)
    spend.record(prompt_chars=400, prompt_tokens=100, completion_tokens=20)
    assert spend.cost_usd == pytest.approx(0.12)
    # estimates now follow the observed 0.25 tokens per character (x 1.25 margin)
    assert spend.reserve(400, 100) == pytest.approx((400 * 0.25 * 1.25 + 16 + 100) * 0.001)


def test_spend_without_a_budget_never_refuses():
    spend = SpendTracker(None, None)
    assert spend.reserve(10**9, 10**6) == 0.0 and spend.cost_usd is None


def test_reply_text_reads_chat_completion_bodies():
    body = {"choices": [{"message": {"role": "assistant", "content": "Preferred: A"}}]}
    assert _reply_text(body) == "Preferred: A"
    assert _reply_text({"choices": [{"message": {"content": None}}]}) == ""
    for not_a_completion in ({"choices": []}, {"error": "x"}, "<html>", None):
        assert _reply_text(not_a_completion) is None
