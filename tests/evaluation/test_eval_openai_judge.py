"""The openai judge against a real local HTTP server speaking /v1/chat/completions, through the real openai client."""

from __future__ import annotations

import json
import sqlite3
from contextlib import closing

import pytest

from rloo_engine.evaluation import JudgeEndpointError, run_evaluation
from rloo_engine.evaluation.pairings import orders_for
from rloo_engine.evaluation.report import format_summary
from rloo_engine.evaluation.result_checks import UntrustworthyResultError
from rloo_engine.testing.fake_openai_server import rate_limited, slow_first
from tests.evaluation.eval_helpers import API_KEY


def test_sensible_judge_gives_the_expected_win_rates(fake_server, make_config):
    server = fake_server("sensible")
    report = run_evaluation(make_config(server))

    pol, sft, head = (report.pairings[n] for n in ("policy_vs_reference", "sft_vs_reference", "policy_vs_sft"))
    assert (pol.n_win, pol.n_loss, pol.n_tie, pol.win_rate) == (7, 3, 0, 0.7)
    assert (sft.n_win, sft.n_loss, sft.n_tie, sft.win_rate) == (4, 6, 0, 0.4)
    # policy vs SFT: 3 wins, 4 losses, 3 prompts the rule cannot separate ("A" both times -> tie)
    assert (head.n_win, head.n_loss, head.n_tie, head.win_rate) == (3, 4, 3, 0.45)
    assert pol.consistency_rate == sft.consistency_rate == 1.0
    assert head.consistency_rate == pytest.approx(0.7)
    assert pol.first_slot_rate == 0.5
    assert all(r.n == r.n_valid == 10 and r.n_parse_error == r.n_api_error == 0 for r in report.pairings.values())
    assert pol.ci_low <= pol.win_rate <= pol.ci_high
    assert report.paired_difference.difference == pytest.approx(0.3)
    assert report.paired_difference.n == 10
    # 3 pairings x 10 prompts x 2 orders, one request each; the key reached the server as a bearer token
    assert server.request_count == 60 == report.usage.requests == report.usage.judgments_made
    assert {r.authorization for r in server.requests} == {f"Bearer {API_KEY}"}
    assert report.results_path.is_file() and report.judgments_path.is_file()


def test_always_a_judge_gives_zero_consistency_and_ties_in_both_order_mode(fake_server, make_config):
    report = run_evaluation(make_config(fake_server("always_a")))
    for r in report.pairings.values():
        assert r.consistency_rate == 0.0
        assert r.first_slot_rate == 1.0
        assert (r.n_win, r.n_loss, r.n_tie) == (0, 0, 10)
        assert r.win_rate == 0.5


def test_always_a_judge_in_average_mode_counts_each_order_as_half(fake_server, make_config):
    report = run_evaluation(make_config(fake_server("always_a"), both_orders_rule="average"))
    r = report.pairings["policy_vs_reference"]
    assert (r.n_win, r.n_loss, r.n_tie) == (10, 10, 0)  # one win and one loss per prompt
    assert r.win_rate == 0.5


def test_single_order_mode_uses_a_seeded_order_per_prompt(fake_server, make_config, eval_files):
    server = fake_server("always_a")
    report = run_evaluation(make_config(server, order_mode="single", seed=3, pairings=["policy_vs_reference"]))
    r = report.pairings["policy_vs_reference"]
    rows = report.table()
    expected_first = sum(orders_for(row["prompt_id"], "single", 3) == ("ab",) for row in rows)
    assert server.request_count == 10  # one call per prompt
    assert r.win_rate == expected_first / 10  # "A" always wins, so the policy wins exactly where it was shown first
    assert r.consistency_rate is None
    assert "consistency    n/a  " in format_summary(report) and "n/a%" not in format_summary(report)
    assert {row["order"] for row in rows} == {"ab", "ba"}  # a seeded coin, not a fixed order
    other_seed = [orders_for(row["prompt_id"], "single", 4) for row in rows]
    assert other_seed != [(row["order"],) for row in rows]


def test_429_with_retry_after_is_retried_after_the_asked_delay(fake_server, make_config):
    server = fake_server(lambda req: rate_limited(req, retry_after_s=0.3))
    report = run_evaluation(make_config(server, pairings=["policy_vs_reference"], max_prompts=3))
    r = report.pairings["policy_vs_reference"]
    assert r.n_api_error == 0 and r.n_valid == 3
    assert server.request_count == 12  # every request: one 429, then one success
    for answers in server.first_ask_counts():
        times = sorted(q.time for q in server.requests if (q.answer_a, q.answer_b) == answers)
        assert times[1] - times[0] >= 0.28  # Retry-After honoured (the jittered backoff alone is ~0.01 s)


def test_repeated_500s_end_as_counted_api_errors(fake_server, make_config):
    server = fake_server("server_error")
    with pytest.raises(UntrustworthyResultError) as err:  # no valid judgment: the run fails, with its counts
        run_evaluation(make_config(server, pairings=["policy_vs_reference"], max_prompts=3))
    report = err.value.report
    r = report.pairings["policy_vs_reference"]
    assert (r.n, r.n_api_error, r.n_valid, r.win_rate) == (3, 3, 0, None)
    assert server.request_count == 3 * 2 * 3  # prompts x orders x max_attempts: bounded retries
    assert any("api_error" in w for w in report.warnings)
    rows = report.table()
    assert {row["status"] for row in rows} == {"api_error"}
    assert all("HTTP 500" in row["error"] and "3 attempts" in row["error"] for row in rows)
    # api errors are not cached: a rerun tries them again
    with closing(sqlite3.connect(report.cache_path)) as db:
        assert db.execute("SELECT COUNT(*) FROM judgments").fetchone()[0] == 0


def test_a_timeout_is_retried(fake_server, make_config):
    # The first sight of each request outlasts the timeout 5 times over; the answer to the retry is immediate, so
    # 1 s leaves a loaded machine plenty of room (0.3 s did not).
    server = fake_server(lambda req: slow_first(req, delay_s=5.0))
    cfg = make_config(server, pairings=["policy_vs_reference"], max_prompts=2, judge={"timeout_s": 1.0})
    report = run_evaluation(cfg)
    r = report.pairings["policy_vs_reference"]
    assert r.n_api_error == 0 and r.n_valid == 2 and r.win_rate == 1.0
    assert all(count == 2 for count in server.first_ask_counts().values())  # timed out once, then answered


def test_malformed_text_is_reasked_once_then_counted_as_parse_error(fake_server, make_config):
    server = fake_server("malformed")
    with pytest.raises(UntrustworthyResultError) as err:
        run_evaluation(make_config(server, pairings=["policy_vs_reference"], max_prompts=3))
    report = err.value.report
    r = report.pairings["policy_vs_reference"]
    assert (r.n_parse_error, r.n_valid, r.win_rate) == (3, 0, None)
    asks = [q for q in server.requests if not q.is_reask]
    reasks = [q for q in server.requests if q.is_reask]
    assert len(asks) == len(reasks) == 6  # one re-ask per judgment, no more
    rows = report.table()
    assert all(row["status"] == "parse_error" and row["parsed_verdict"] is None for row in rows)
    assert all(row["raw_verdict"] and row["raw_verdict_reask"] for row in rows)  # raw text kept for offline re-parsing


def test_a_reask_that_parses_gives_a_verdict(fake_server, make_config):
    server = fake_server("malformed_then_ok")
    report = run_evaluation(make_config(server, pairings=["policy_vs_reference"], max_prompts=3))
    r = report.pairings["policy_vs_reference"]
    assert r.n_parse_error == 0 and r.n_valid == 3
    assert r.first_slot_rate == 1.0  # the re-ask answers "A"


def test_401_fails_fast_naming_endpoint_and_model_without_the_key(fake_server, make_config):
    server = fake_server("unauthorized")
    with pytest.raises(JudgeEndpointError) as err:
        run_evaluation(make_config(server, judge={"max_concurrency": 2}))
    message = str(err.value)
    assert server.base_url in message and "fake-judge" in message and "401" in message
    assert API_KEY not in message and API_KEY not in repr(err.value)
    # run_evaluation's event loop is closed once it raises, so nothing more can be sent: no need to wait.
    assert server.request_count <= 2  # no retries, and the other 58 judgments were never sent


def test_a_second_run_sends_zero_requests(fake_server, make_config):
    server = fake_server("sensible")
    cfg = make_config(server)
    first = run_evaluation(cfg)
    sent = server.request_count
    second = run_evaluation(cfg)
    assert server.request_count == sent
    assert second.usage.requests == 0 and second.usage.judgments_cached == 60 and second.usage.judgments_made == 0
    assert {n: r.win_rate for n, r in second.pairings.items()} == {n: r.win_rate for n, r in first.pairings.items()}
    assert all(row["cached"] for row in second.table())


def test_requests_in_flight_never_exceed_max_concurrency(fake_server, make_config):
    server = fake_server("sensible", latency_s=0.05)
    run_evaluation(make_config(server, pairings=["policy_vs_reference"], judge={"max_concurrency": 3}))
    assert server.max_in_flight == 3


def test_requests_per_minute_spaces_requests(fake_server, make_config):
    server = fake_server("sensible")
    cfg = make_config(server, pairings=["policy_vs_reference"], max_prompts=4, judge={"requests_per_minute": 1200})
    run_evaluation(cfg)
    times = sorted(q.time for q in server.requests)
    assert len(times) == 8
    assert times[-1] - times[0] >= 7 * 0.05 * 0.9  # 1200/min = one every 50 ms


def test_token_usage_and_cost_follow_the_price_table(fake_server, make_config):
    server = fake_server("sensible")
    prices = {"fake-judge": {"input_per_million": 2.5, "output_per_million": 10.0}}
    report = run_evaluation(make_config(server, pairings=["policy_vs_reference"], prices=prices))
    rows = report.table()
    prompt_tokens = sum(row["prompt_tokens"] for row in rows)
    completion_tokens = sum(row["completion_tokens"] for row in rows)
    assert prompt_tokens > 0 and completion_tokens > 0
    assert (report.usage.prompt_tokens, report.usage.completion_tokens) == (prompt_tokens, completion_tokens)
    assert report.usage.cost_usd == pytest.approx((prompt_tokens * 2.5 + completion_tokens * 10.0) / 1e6)
    again = run_evaluation(make_config(server, pairings=["policy_vs_reference"], prices=prices))
    assert again.usage.cost_usd == 0 and again.usage.total_cost_usd == pytest.approx(report.usage.cost_usd)


def test_results_json_holds_every_count_next_to_the_rate(fake_server, make_config):
    report = run_evaluation(make_config(fake_server("sensible")))
    data = json.loads(report.results_path.read_text())
    entry = data["pairings"]["policy_vs_reference"]
    for field in (
        "win_rate",
        "se",
        "ci_low",
        "ci_high",
        "lc_win_rate",
        "lc_ci_low",
        "lc_ci_high",
        "n",
        "n_valid",
        "n_parse_error",
        "n_api_error",
        "consistency_rate",
        "first_slot_rate",
        "mean_length_a",
    ):
        assert field in entry
    assert data["judge"]["template"]["hash"] == report.table()[0]["template_hash"]
    assert data["config"]["judge"]["api_key_env"] == "RLOO_TEST_JUDGE_KEY"
