"""The live openai judge as openai-client users expect it, against the fake judge server: account headers,
Azure-style deployment URLs and keys, and the failures that must not be retried."""

from __future__ import annotations

import sqlite3
from collections import Counter
from contextlib import closing

import pytest

from rloo_engine.config_base import ConfigError
from rloo_engine.evaluation import EvalConfig, JudgeEndpointError, run_evaluation
from rloo_engine.evaluation.config import build_eval_config
from rloo_engine.evaluation.parsing import PARSER_VERSION
from rloo_engine.evaluation.result_checks import UntrustworthyResultError
from rloo_engine.evaluation.retry import RetryPolicy, retry_after_seconds
from rloo_engine.testing.fake_openai_server import FakeReply, sensible
from tests.evaluation.eval_helpers import API_KEY, config_values

ONE_PAIRING = {"pairings": ["policy_vs_reference"], "max_prompts": 2}


def test_organization_and_project_from_the_environment_are_sent(fake_server, make_config, monkeypatch):
    monkeypatch.setenv("OPENAI_ORG_ID", "org-from-env")
    monkeypatch.setenv("OPENAI_PROJECT_ID", "proj_from_env")
    server = fake_server("sensible")
    run_evaluation(make_config(server, **ONE_PAIRING))
    assert {(r.headers.get("openai-organization"), r.headers.get("openai-project")) for r in server.requests} == {
        ("org-from-env", "proj_from_env")
    }


def test_organization_and_project_in_the_judge_config_win_over_the_environment(fake_server, make_config, monkeypatch):
    monkeypatch.setenv("OPENAI_ORG_ID", "org-from-env")
    monkeypatch.delenv("OPENAI_PROJECT_ID", raising=False)
    server = fake_server("sensible")
    run_evaluation(make_config(server, judge={"organization": "org-cfg", "project": "proj_cfg"}, **ONE_PAIRING))
    assert {(r.headers.get("openai-organization"), r.headers.get("openai-project")) for r in server.requests} == {
        ("org-cfg", "proj_cfg")
    }


def test_without_organization_or_project_no_such_header_is_sent(fake_server, make_config, monkeypatch):
    monkeypatch.delenv("OPENAI_ORG_ID", raising=False)
    monkeypatch.delenv("OPENAI_PROJECT_ID", raising=False)
    server = fake_server("sensible")
    run_evaluation(make_config(server, **ONE_PAIRING))
    assert not any({"openai-organization", "openai-project"} & set(r.headers) for r in server.requests)


def test_an_azure_deployment_url_keeps_its_query_after_the_path_and_the_key_goes_in_api_key(
    fake_server, eval_files, tmp_path, api_key
):
    server = fake_server("sensible")
    base = f"http://127.0.0.1:{server.port}/openai/deployments/gpt4o?api-version=2024-06-01"
    values = config_values(eval_files, base, tmp_path / "out", **ONE_PAIRING)
    values["judge"]["api_key_header"] = "api-key"
    report = run_evaluation(EvalConfig.model_validate(values))
    assert report.pairings["policy_vs_reference"].n_valid == 2
    assert {r.path for r in server.requests} == {"/openai/deployments/gpt4o/chat/completions?api-version=2024-06-01"}
    assert {r.headers.get("api-key") for r in server.requests} == {api_key}
    assert not any("authorization" in r.headers for r in server.requests)  # the key is sent once, in api-key


def test_the_default_key_header_is_a_bearer_authorization(fake_server, make_config):
    server = fake_server("sensible")
    run_evaluation(make_config(server, **ONE_PAIRING))
    assert {r.authorization for r in server.requests} == {f"Bearer {API_KEY}"}
    assert not any("api-key" in r.headers for r in server.requests)


@pytest.mark.parametrize(
    ("judge", "expected"),
    [
        ({"api_key_header": "bearer"}, "judge.api_key_header: Input should be 'authorization' or 'api-key'"),
        ({"api_key_header": "api-key", "mode": "batch"}, "judge.api_key_header: 'api-key' with mode 'batch'"),
    ],
)
def test_api_key_header_is_validated(eval_files, tmp_path, api_key, judge, expected):
    values = config_values(eval_files, "http://127.0.0.1:1/v1", tmp_path / "out")
    values["judge"].update(judge)
    with pytest.raises(ConfigError, match=expected):
        build_eval_config(values)


def test_a_reply_over_max_response_bytes_is_one_counted_api_error(fake_server, make_config):
    server = fake_server(lambda req: FakeReply(text="x" * 5000 + "\nPreferred: A"))
    cfg = make_config(server, judge={"max_response_bytes": 1024}, **ONE_PAIRING)
    with pytest.raises(UntrustworthyResultError) as err:  # nothing valid: the run fails, with its counts
        run_evaluation(cfg)
    rows = err.value.report.table()
    assert len(rows) == 4 and {row["status"] for row in rows} == {"api_error"}
    assert all("max_response_bytes 1024" in row["error"] for row in rows)
    assert server.request_count == 4  # one request per judgment: not retried


@pytest.mark.parametrize("value", ["nan", "NaN", "inf", "-inf", "-5", "1e400"])
@pytest.mark.parametrize("header", ["retry-after", "retry-after-ms"])
def test_a_non_finite_or_negative_retry_after_is_ignored_and_the_backoff_cap_holds(header, value):
    assert retry_after_seconds({header: value}) is None
    policy = RetryPolicy(max_attempts=6, initial_s=1.0, max_s=8.0)
    for attempt in range(1, 6):
        delay = policy.delay(attempt, retry_after_seconds({header: value}))
        assert 0.0 < delay <= 8.0  # the jittered backoff, as if the header were absent


def test_an_unreadable_retry_after_ms_falls_back_to_retry_after():
    assert retry_after_seconds({"retry-after-ms": "nan", "retry-after": "2"}) == 2.0


def _refusal(req) -> FakeReply:
    message = {"role": "assistant", "content": None, "refusal": "I can't help with comparing these."}
    return FakeReply(body={"model": "fake-judge", "choices": [{"index": 0, "message": message, "finish_reason": "stop"}]})


def test_a_refusal_is_one_counted_judgment_failure_neither_retried_nor_reasked(fake_server, make_config):
    server = fake_server(_refusal)
    with pytest.raises(UntrustworthyResultError) as err:
        run_evaluation(make_config(server, **ONE_PAIRING))
    r = err.value.report.pairings["policy_vs_reference"]
    assert (r.n_parse_error, r.n_api_error) == (2, 0)
    assert server.request_count == 4  # 2 prompts x 2 orders, one request each
    assert all("refused" in row["error"] and "I can't help" in row["error"] for row in err.value.report.table())
    assert err.value.report.usage.prompt_tokens > 0  # a refusal is billed, so it counts toward the budget


def _quota_exhausted(req) -> FakeReply:
    error = {
        "message": "You exceeded your current quota, please check your plan and billing details.",
        "type": "insufficient_quota",
        "code": "insufficient_quota",
    }
    return FakeReply(429, error_body={"error": error})


def test_insufficient_quota_stops_the_run_at_once_naming_the_quota(fake_server, make_config):
    server = fake_server(_quota_exhausted)
    with pytest.raises(JudgeEndpointError, match="insufficient_quota") as err:
        run_evaluation(make_config(server, judge={"max_concurrency": 1}, **ONE_PAIRING))
    assert "quota" in str(err.value) and "retrying cannot help" in str(err.value)
    assert server.request_count == 1  # not retried, and nothing sent after it


# ---------------------------------------------------------------- what the cache knows of the model behind an alias
def _snapshot(name: str):
    return lambda req: FakeReply(text=sensible(req).text, served_model=name)


def test_a_judge_alias_served_by_a_new_snapshot_is_warned_about_next_to_the_numbers(fake_server, make_config):
    old = fake_server(_snapshot("fake-judge-2024-01"))
    run_evaluation(make_config(old, pairings=["policy_vs_reference"], max_prompts=3))
    new = fake_server(_snapshot("fake-judge-2024-06"))
    report = run_evaluation(make_config(new, pairings=["policy_vs_reference"], max_prompts=5))
    assert report.usage.judgments_cached == 6 and report.usage.judgments_made == 4
    (warning,) = [w for w in report.warnings if "snapshot" in w]
    assert "'fake-judge'" in warning
    assert "fake-judge-2024-01 (6 cached)" in warning and "fake-judge-2024-06 (4 new)" in warning
    assert report.judge["served_models"] == {"fake-judge-2024-01": 6, "fake-judge-2024-06": 4}
    rows = report.table()
    assert {row["served_model"] for row in rows if row["cached"]} == {"fake-judge-2024-01"}
    assert {row["served_model"] for row in rows if not row["cached"]} == {"fake-judge-2024-06"}
    with closing(sqlite3.connect(report.cache_path)) as db:
        stored = Counter(m for (m,) in db.execute("SELECT served_model FROM judgments"))
    assert stored == {"fake-judge-2024-01": 6, "fake-judge-2024-06": 4}


def test_one_snapshot_throughout_gives_no_warning(fake_server, make_config):
    server = fake_server(_snapshot("fake-judge-2024-01"))
    run_evaluation(make_config(server, pairings=["policy_vs_reference"], max_prompts=3))
    report = run_evaluation(make_config(server, pairings=["policy_vs_reference"], max_prompts=5))
    assert not [w for w in report.warnings if "snapshot" in w]


def _as_written_by_an_older_version(cache_path) -> None:
    """Every cached judgment becomes a parse_error of a cache file from before served_model / parser_version (and
    slot_a_probability / reference)."""
    with closing(sqlite3.connect(cache_path)) as db:
        columns = {row[1] for row in db.execute("PRAGMA table_info(judgments)")}
        for name in ("served_model", "parser_version", "slot_a_probability", "reference"):
            if name in columns:
                db.execute(f"ALTER TABLE judgments DROP COLUMN {name}")
        db.execute("UPDATE judgments SET status = 'parse_error', verdict = NULL, error = 'no verdict line'")
        db.commit()


def test_cached_parse_errors_of_an_older_parser_are_reparsed_without_a_request(fake_server, make_config):
    server = fake_server("sensible")
    cfg = make_config(server, pairings=["policy_vs_reference"], max_prompts=3)
    first = run_evaluation(cfg)
    _as_written_by_an_older_version(first.cache_path)
    sent_before = server.request_count

    again = run_evaluation(cfg)
    assert server.request_count == sent_before  # the stored replies were parsed again, not re-asked
    assert again.pairings["policy_vs_reference"].win_rate == first.pairings["policy_vs_reference"].win_rate
    assert again.usage.judgments_cached == 6
    with closing(sqlite3.connect(first.cache_path)) as db:  # the old file was migrated in place
        rows = set(db.execute("SELECT status, parser_version FROM judgments"))
    assert rows == {("ok", PARSER_VERSION)}


def test_a_non_numeric_completion_count_is_estimated_not_a_crash(fake_server, make_config):
    """The batch path's defect 9 in the live path: `usage.completion_tokens: "n/a"` raised ValueError."""
    def odd_usage(req):
        verdict = sensible(req).text
        return FakeReply(body={"model": "fake-judge", "choices": [{"message": {"content": verdict},
                                                                   "finish_reason": "stop"}],
                               "usage": {"prompt_tokens": 120, "completion_tokens": "n/a"}})

    report = run_evaluation(make_config(fake_server(odd_usage), **ONE_PAIRING))
    assert report.pairings["policy_vs_reference"].n_valid == 2
    assert report.usage.prompt_tokens == 120 * report.usage.judgments_made  # the reported count is kept
    assert report.usage.completion_tokens > 0  # the unusable one is estimated


# ---------------------------------------------------------------- `content: null` with no refusal text (issue 41)
def _null_content(req) -> FakeReply:
    """`content: null` and no `refusal` field: the message carries no answer and no refusal."""
    message = {"role": "assistant", "content": None}
    return FakeReply(body={"model": "fake-judge", "choices": [{"index": 0, "message": message, "finish_reason": "stop"}]})


def _null_content_then_sensible(req) -> FakeReply:
    return _null_content(req) if req.seen_before == 0 else sensible(req)


def test_null_content_without_a_refusal_is_retried_like_an_empty_reply(fake_server, make_config):
    server = fake_server(_null_content_then_sensible)
    report = run_evaluation(make_config(server, **ONE_PAIRING))
    r = report.pairings["policy_vs_reference"]
    assert (r.n_valid, r.n_parse_error, r.n_api_error) == (2, 0, 0)
    assert server.request_count == 8  # 2 prompts x 2 orders, each asked twice
    assert all(row["status"] == "ok" for row in report.table())


def test_null_content_every_time_ends_as_an_uncached_api_error_not_a_refusal(fake_server, make_config):
    server = fake_server(_null_content)
    with pytest.raises(UntrustworthyResultError) as err:
        run_evaluation(make_config(server, **ONE_PAIRING))
    r = err.value.report.pairings["policy_vs_reference"]
    assert (r.n_parse_error, r.n_api_error) == (0, 2)
    assert server.request_count == 12  # every judgment tried max_attempts (3) times
    rows = err.value.report.table()
    assert all("empty reply" in row["error"] and "refused" not in row["error"] for row in rows)
    with closing(sqlite3.connect(err.value.report.cache_path)) as db:
        assert db.execute("SELECT COUNT(*) FROM judgments").fetchone() == (0,)  # retried again on the next run
