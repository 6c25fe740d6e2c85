"""Numbers users can trust: runs that judged nothing fail, duplicates are refused, stored text is redacted,
transient empty replies are retried (not cached), and unambiguous verdict forms parse without a paid re-ask."""

from __future__ import annotations

import logging
import socket
import sqlite3
import time
from contextlib import closing

import pytest
import yaml

from rloo_engine.evaluation import ConfigError, EvalConfig, EvaluationError, JudgeEndpointError, run_evaluation
from rloo_engine.evaluation.cli import main as evaluate_main
from rloo_engine.evaluation.parsing import parse_verdict
from rloo_engine.evaluation.result_checks import UntrustworthyResultError
from rloo_engine.testing.fake_openai_server import FakeReply, sensible, verdict_text
from tests.evaluation.eval_helpers import API_KEY, make_eval_files, write_jsonl


# ---------------------------------------------------------------- 3. a run that judged nothing fails
def test_a_pairing_with_no_valid_judgment_raises_and_the_cli_exits_non_zero(
    fake_server, make_config, tmp_path, capsys
):
    server = fake_server("server_error")
    cfg = make_config(server, pairings=["policy_vs_reference"], max_prompts=3)
    with pytest.raises(EvaluationError) as err:
        run_evaluation(cfg)
    message = str(err.value)
    assert "policy_vs_reference" in message and "no valid judgment" in message and "3 api_error" in message
    assert not (tmp_path / "out" / "results.json").exists()  # no result pretending to be one
    config_file = tmp_path / "cli.yaml"
    config_file.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    assert evaluate_main(["--config", str(config_file), "--no_progress"]) == 1
    assert "no valid judgment" in capsys.readouterr().err


def test_failed_judgments_above_the_allowed_fraction_fail_the_run(fake_server, make_config):
    # the first prompt's requests (policy answer "a good summary 0") always fail; the other nine are judged
    def flaky(req):
        if "summary 0" in f"{req.answer_a} {req.answer_b}":
            return FakeReply(500, error_body={"error": {"message": "boom"}})
        return sensible(req)

    server = fake_server(flaky)
    with pytest.raises(EvaluationError) as err:
        run_evaluation(make_config(server, pairings=["policy_vs_reference"], max_failed_fraction=0.05))
    assert "max_failed_fraction" in str(err.value) and "1 of 10" in str(err.value)
    cfg = make_config(server, out="lenient", pairings=["policy_vs_reference"], max_failed_fraction=0.2)
    report = run_evaluation(cfg)
    assert report.pairings["policy_vs_reference"].n_api_error == 1


def test_completions_whose_ids_match_no_prompt_fail_before_any_call(fake_server, make_config, tmp_path):
    server = fake_server("sensible")
    other = write_jsonl(tmp_path / "other.jsonl", [{"prompt": f"unrelated {i}", "completion": "x"} for i in range(5)])
    with pytest.raises(EvaluationError) as err:
        run_evaluation(make_config(server, pairings=["policy_vs_reference"], policy_completions=str(other)))
    assert "policy_vs_reference" in str(err.value) and "10 of 10" in str(err.value)
    assert server.request_count == 0


def test_an_empty_completions_file_is_refused(fake_server, make_config, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ConfigError) as err:
        run_evaluation(make_config(fake_server("sensible"), policy_completions=str(empty)))
    assert str(empty) in str(err.value) and "no completions" in str(err.value)


def test_an_unreachable_endpoint_stops_after_the_first_connection_failures(make_config):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    class Dead:
        base_url = f"http://127.0.0.1:{port}/v1"

    cfg = make_config(Dead(), judge={"max_attempts": 50, "backoff_initial_s": 0.2, "connect_failure_limit": 4})
    started = time.monotonic()
    with pytest.raises(JudgeEndpointError) as err:
        run_evaluation(cfg)
    assert time.monotonic() - started < 10  # not 60 prompts x 50 attempts of backoff
    assert Dead.base_url in str(err.value) and "first 4 requests" in str(err.value)


# ---------------------------------------------------------------- 4. duplicate completion ids
def test_duplicate_completion_ids_are_rejected_with_file_line_and_id(fake_server, make_config, tmp_path):
    files = make_eval_files(tmp_path / "dup")
    prompt = next(iter(files.policy_texts))
    lines = files.policy.read_text().splitlines() + [f'{{"prompt": "{prompt}", "completion": "another"}}']
    files.policy.write_text("\n".join(lines) + "\n")
    with pytest.raises(ConfigError) as err:
        run_evaluation(make_config(fake_server("sensible"), policy_completions=str(files.policy)))
    message = str(err.value)
    assert f"{files.policy}:11" in message and "line 1" in message and "duplicate" in message


# ---------------------------------------------------------------- 5. the key in text from the endpoint
def _echo_key_in_text(req):
    key = req.authorization.removeprefix("Bearer ")
    return FakeReply(text=f"Your key {key} looks fine.\nPreferred: A")


def _echo_key_in_body(req):
    key = req.authorization.removeprefix("Bearer ")
    if req.seen_before == 0:
        return FakeReply(body={"object": "error.echo", "detail": f"request signed with {key}"})
    return FakeReply(text=f"Checked {key}.\n{verdict_text('B')}")


def test_a_key_echoed_in_a_200_reply_is_redacted_everywhere_it_is_stored(fake_server, make_config, tmp_path, caplog):
    caplog.set_level(logging.DEBUG)
    texts = run_evaluation(make_config(fake_server(_echo_key_in_text), out="text", max_prompts=2))
    bodies = run_evaluation(make_config(fake_server(_echo_key_in_body), out="body", max_prompts=2))
    assert texts.pairings["policy_vs_reference"].n_valid == 2 and bodies.pairings["policy_vs_reference"].n_valid == 2
    rows = texts.table()
    assert all("***" in row["raw_verdict"] for row in rows)  # the text is kept, the key is not
    for path in [p for p in tmp_path.rglob("*") if p.is_file()]:
        assert API_KEY.encode() not in path.read_bytes(), path
    assert API_KEY not in caplog.text


# ---------------------------------------------------------------- 6. transient empty replies
def _empty_first(req):
    return FakeReply(text="") if req.seen_before == 0 else sensible(req)


def _always_empty(req):
    return FakeReply(text="   ")


def test_a_transient_empty_reply_is_retried_not_cached_as_a_parse_error(fake_server, make_config):
    server = fake_server(_empty_first)
    report = run_evaluation(make_config(server, pairings=["policy_vs_reference"], max_prompts=3))
    r = report.pairings["policy_vs_reference"]
    assert (r.n_valid, r.n_parse_error) == (3, 0)
    assert not any(q.is_reask for q in server.requests)  # retried as a failed call, not re-asked for a format


def test_replies_that_stay_empty_are_api_errors_that_a_rerun_retries(fake_server, make_config):
    server = fake_server(_always_empty)
    cfg = make_config(server, pairings=["policy_vs_reference"], max_prompts=2)
    with pytest.raises(UntrustworthyResultError) as err:
        run_evaluation(cfg)
    report = err.value.report
    r = report.pairings["policy_vs_reference"]
    assert (r.n_api_error, r.n_parse_error) == (2, 0)
    assert all("empty reply" in row["error"] for row in report.table())
    with closing(sqlite3.connect(report.cache_path)) as db:
        assert db.execute("SELECT COUNT(*) FROM judgments").fetchone()[0] == 0
    sent = server.request_count
    with pytest.raises(UntrustworthyResultError):
        run_evaluation(cfg)
    assert server.request_count == 2 * sent  # asked again: nothing was cached


def test_real_parse_failures_are_still_cached(fake_server, make_config):
    server = fake_server("malformed")
    cfg = make_config(server, pairings=["policy_vs_reference"], max_prompts=2)
    with pytest.raises(UntrustworthyResultError) as err:
        run_evaluation(cfg)
    assert err.value.report.pairings["policy_vs_reference"].n_parse_error == 2
    sent = server.request_count
    with pytest.raises(UntrustworthyResultError):
        run_evaluation(cfg)
    assert server.request_count == sent


# ---------------------------------------------------------------- 7. unambiguous verdict forms
@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Preferred: A\nSummary A keeps the key point; B misses it.", "A"),  # verdict, then prose
        ("Summary B is clearer and shorter. Preferred: B", "B"),  # verdict at the end of a prose line
        ("Comparison: ...\nPreferred: Summary A", "A"),
        ("Comparison: ...\nPreferred: Response B.", "B"),
        ("Comparison: x\n**Preferred: Summary B**\nHope this helps!", "B"),
        ("Preferred: A\nPreferred: A", "A"),  # repeated, but consistent
    ],
)
def test_unambiguous_verdict_forms_parse(text, expected):
    assert parse_verdict(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        "Preferred: A\nOn reflection, Preferred: B",  # two different verdicts
        "Preferred: A or B",
        "Preferred: A/B",
        "Preferred: AB",
        'Preferred: <"A" or "B">',
        "Preferred: Summary C",
        "Summary A is better.",
        "Preferred: A, but B is close",
        "I would have Preferred: A if it were shorter, but it is not; neither wins.",
    ],
)
def test_ambiguous_verdicts_are_still_refused(text):
    assert parse_verdict(text) is None


def test_verdict_followed_by_prose_costs_no_reask(fake_server, make_config):
    def verdict_then_prose(req):
        slot = sensible(req).text[-1]
        return FakeReply(text=f"Preferred: {slot}\nBecause it keeps the key point.")

    server = fake_server(verdict_then_prose)
    report = run_evaluation(make_config(server, pairings=["policy_vs_reference"]))
    assert report.pairings["policy_vs_reference"].win_rate == 0.7
    assert server.request_count == 20


# ---------------------------------------------------------------- 8. inputs checked before anything expensive
def test_check_inputs_names_a_missing_rule_prompts_file_or_unmatched_references(tmp_path, eval_files):
    from rloo_engine.evaluation.preflight import check_inputs

    def values(**overrides):
        v = {
            "prompts": str(eval_files.prompts),
            "reference_column": "reference",
            "judge": {"backend": "python", "function": "tests.evaluation.eval_helpers:prefer_longer"},
        }
        v.update(overrides)
        return EvalConfig.model_validate(v)

    assert check_inputs(values()) == {"prompts": 10, "reference": 10}
    cases = {
        "no_such_rule": values(judge={"backend": "python", "function": "tests.evaluation.eval_helpers:no_such_rule"}),
        "missing.jsonl": values(prompts=str(tmp_path / "missing.jsonl")),
        "reference_completions": values(
            reference_column=None,
            reference_completions=str(write_jsonl(tmp_path / "r.jsonl", [{"prompt": "other", "completion": "x"}])),
        ),
    }
    for expected, cfg in cases.items():
        with pytest.raises(ConfigError) as err:
            check_inputs(cfg)
        assert expected in str(err.value), err.value
