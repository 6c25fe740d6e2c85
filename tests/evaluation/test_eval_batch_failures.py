"""`judge.mode: batch` failure paths (issue 23): refused endpoints, the budget across batches, double
submissions, file sizes, and output the judge cannot read. Each test failed on the code before its fix."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import threading
import time
import traceback
from contextlib import closing

import pytest
import yaml

from rloo_engine.evaluation import BudgetExceededError, ConfigError, JudgeEndpointError, run_evaluation
from rloo_engine.evaluation.budget import Price, SpendTracker
from rloo_engine.evaluation.cache import JudgmentCache
from rloo_engine.evaluation.cli import main as evaluate_main
from rloo_engine.evaluation.config import build_eval_config
from rloo_engine.evaluation.judges import build_judge
from rloo_engine.evaluation.judges.base import SlotPair
from rloo_engine.evaluation.result_checks import UntrustworthyResultError
from rloo_engine.evaluation.templates import load_template
from rloo_engine.testing.fake_openai_server import FakeReply, sensible, verdict_text
from tests.evaluation.eval_helpers import API_KEY, recreate_first_batch

BATCH = {"mode": "batch", "batch_poll_initial_s": 0.01, "batch_poll_max_s": 0.05}


def _rows_of(server, batch_index: int) -> int:
    return len(list(server.batch_api.batches.values())[batch_index].rows)


def _billed_usd(server, input_per_million: float, output_per_million: float) -> float:
    """What the fake Batch API's answers would cost at batch prices (half the live ones), from their usage."""
    tokens = 0.0
    for batch in server.batch_api.batches.values():
        if batch.output_file_id:
            for line in server.batch_api.files[batch.output_file_id].decode().splitlines():
                usage = json.loads(line)["response"]["body"]["usage"]
                tokens += usage["prompt_tokens"] * input_per_million + usage["completion_tokens"] * output_per_million
    return tokens / 1e6 / 2


def _chain(err: BaseException | None) -> list[BaseException]:
    """`err` and every exception chained to it (cause or context), as a traceback would print them."""
    found = []
    while err is not None and err not in found:
        found.append(err)
        err = err.__cause__ or err.__context__
    return found


# ---------------------------------------------------------------- 5. a refused Files/Batches call
def test_a_server_without_the_batch_api_is_a_judge_endpoint_error_with_the_key_redacted(
    fake_server, make_config, tmp_path, capsys
):
    server = fake_server("sensible")
    server.batch_api.refuse_status = 404  # what `vllm serve` answers on /v1/files; the body echoes the key
    cfg = make_config(server, judge=BATCH)

    async def judge_directly() -> None:
        with JudgmentCache(tmp_path / "direct.sqlite") as store:
            judge = build_judge(cfg.judge, load_template(cfg.judge.template), SpendTracker(), batch_store=store)
            try:
                await judge.judge([SlotPair("a prompt", "answer one", "answer two")])
            finally:
                await judge.aclose()

    with pytest.raises(JudgeEndpointError) as err:
        asyncio.run(judge_directly())
    assert ("POST", "/files") in server.batch_api.calls  # the key was sent, and echoed back
    message = str(err.value)
    assert "HTTP 404" in message and "uploading the batch file" in message and "judge.mode: live" in message
    printed = "".join(traceback.format_exception(err.value))
    for shown in [printed, *(str(e) for e in _chain(err.value)), *(repr(e) for e in _chain(err.value))]:
        assert API_KEY not in shown

    config_file = tmp_path / "eval.yaml"
    config_file.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    assert evaluate_main(["--config", str(config_file), "--no_progress"]) == 2  # the endpoint refused: a configuration to fix
    stderr = capsys.readouterr().err
    assert stderr.startswith("error: judge batch:") and "HTTP 404" in stderr and API_KEY not in stderr


# ---------------------------------------------------------------- 6. the budget across batches
def test_the_budget_holds_across_batches_and_a_rerun_with_more_budget_submits_only_the_rest(fake_server, make_config):
    server = fake_server("sensible")
    prices = {"fake-judge": {"input_per_million": 80.0, "output_per_million": 0.0}}
    # 20 requests, 2 a batch. The worst case of one batch (~$0.033) fits $0.04, two do not; the fake's token counts
    # are about a quarter of the worst case, so all ten batches together cost ~$0.085 (as the code before the fix
    # spent it, submitting every batch against a budget that forgot each reservation once its batch was sent).
    judge = {**BATCH, "batch_max_requests": 2}
    cfg = make_config(server, judge=judge, prices=prices, budget_usd=0.04, pairings=["policy_vs_reference"])
    with pytest.raises(BudgetExceededError) as err:
        run_evaluation(cfg)
    assert "a batch of 2 requests" in str(err.value)
    submitted = server.batch_api.batches_created
    assert 1 <= submitted < 10 and _billed_usd(server, 80.0, 0.0) <= 0.04
    with JudgmentCache(cfg.resolved_cache_path()) as cache:
        assert cache.count() == 2 * submitted  # every submitted batch was collected before the stop

    report = run_evaluation(cfg.model_copy(update={"budget_usd": 1.0}))
    assert server.batch_api.batches_created == 10 and report.usage.judgments_cached == 2 * submitted
    assert report.pairings["policy_vs_reference"].win_rate == 0.7


def test_a_batch_submitted_by_an_earlier_run_is_held_against_the_budget_though_it_did_not_fit():
    spend = SpendTracker(Price(80.0, 0.0), budget_usd=0.04, model="fake-judge")
    held = spend.hold(1800, 256, rows=2, batch=True)  # resumed: billed whatever this run decides
    assert held == spend.hold(1800, 256, rows=2, batch=True) > 0.02  # two of them: more than the budget, held
    with pytest.raises(BudgetExceededError):
        spend.reserve(10, 1, batch=True)  # nothing new fits beside them
    spend.release(held)
    spend.release(held)
    assert spend.reserve(1800, 256, rows=2, batch=True) == held


# ---------------------------------------------------------------- 7. never submitted twice
def test_two_runs_sharing_a_cache_submit_each_request_once(fake_server, make_config, tmp_path):
    server = fake_server("sensible")
    server.batch_api.upload_delay_s = 3.0  # the first run is still uploading when the second one starts
    shared = {"judge": BATCH, "cache_path": str(tmp_path / "shared.sqlite"), "pairings": ["policy_vs_reference"]}
    outcome: dict = {}

    def first_run() -> None:
        try:
            outcome["report"] = run_evaluation(make_config(server, out="first", **shared))
        except Exception as err:  # shown by the assertion below
            outcome["error"] = err

    thread = threading.Thread(target=first_run)
    thread.start()
    deadline = time.monotonic() + 30
    while server.batch_api.uploads_started == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    second = run_evaluation(make_config(server, out="second", **shared))
    thread.join(timeout=60)
    assert "report" in outcome, outcome
    assert server.batch_api.uploads_started == 1 and server.batch_api.batches_created == 1
    [batch_id] = server.batch_api.batches
    assert outcome["report"].judge["batch"]["batch_ids"] == second.judge["batch"]["batch_ids"] == [batch_id]
    assert second.judge["batch"]["rows"]["rows_resumed"] == 20  # the second run polled the first run's batch
    assert outcome["report"].pairings["policy_vs_reference"].win_rate == 0.7
    assert second.pairings["policy_vs_reference"].win_rate == 0.7
    with closing(sqlite3.connect(shared["cache_path"])) as db:  # the first run's record was kept, and closed
        assert db.execute("SELECT batch_id, state FROM batches").fetchall() == [(batch_id, "collected")]


def _batch_of_an_interrupted_run(server, cfg, state: str) -> str:
    """Puts the cache of `cfg` in the state of a run interrupted after creating its batch (a batch with its
    requests and token exists) and recording it as `state` (`submitting`: no batch id yet, or `open`)."""
    server.batch_api.expire_after_rows = 0  # a first run whose rows all expire leaves their requests to submit
    with pytest.raises(UntrustworthyResultError):
        run_evaluation(cfg)
    server.batch_api.expire_after_rows = None
    with closing(sqlite3.connect(cfg.resolved_cache_path())) as db:
        [token] = db.execute("SELECT token FROM batches").fetchone()
    created = recreate_first_batch(server, token)
    with closing(sqlite3.connect(cfg.resolved_cache_path())) as db:
        batch_id = None if state == "submitting" else created.id
        db.execute("UPDATE batches SET batch_id = ?, state = ?", (batch_id, state))
        db.commit()
    return created.id


def test_a_run_killed_before_it_recorded_its_batch_id_finds_the_batch_behind_150_newer_ones(fake_server, make_config):
    server = fake_server("sensible")
    cfg = make_config(server, judge=BATCH, pairings=["policy_vs_reference"])
    created = _batch_of_an_interrupted_run(server, cfg, "submitting")
    for _ in range(150):  # other jobs on the account since: the list's first page (100) is all theirs
        server.batch_api.add_finished_batch({"job": "someone else's"})
    report = run_evaluation(cfg)
    assert server.batch_api.batches_created == 2 + 150  # the expired one, the one found by its token; no other
    assert report.judge["batch"]["batch_ids"] == [created]
    assert report.pairings["policy_vs_reference"].win_rate == 0.7


def test_a_run_needing_none_of_an_open_batchs_rows_leaves_it_for_the_run_that_does(fake_server, make_config):
    server = fake_server("sensible")
    cfg = make_config(server, judge=BATCH, pairings=["policy_vs_reference"])
    created = _batch_of_an_interrupted_run(server, cfg, "open")
    run_evaluation(make_config(server, judge=BATCH, pairings=["sft_vs_reference"]))  # same judge and cache
    report = run_evaluation(cfg)
    assert server.batch_api.batches_created == 3  # the expired one, the open one, sft_vs_reference's; no other
    assert report.judge["batch"]["batch_ids"] == [created]
    assert report.pairings["policy_vs_reference"].win_rate == 0.7


# ---------------------------------------------------------------- 8. files split by bytes too
def test_batch_files_are_split_by_bytes_and_a_request_over_the_limit_stops_before_any_upload(fake_server, make_config):
    server = fake_server("sensible")
    limit = 4_000  # a request line of this eval set is about 900 bytes
    cfg = make_config(server, judge={**BATCH, "batch_max_bytes": limit}, pairings=["policy_vs_reference"])
    report = run_evaluation(cfg)
    sizes = [len(server.batch_api.files[f]) for f in server.batch_api.uploads]
    assert len(sizes) == 5 and max(sizes) <= limit  # 20 requests, 4 to a file
    assert sum(_rows_of(server, i) for i in range(5)) == 20
    assert report.pairings["policy_vs_reference"].win_rate == 0.7

    too_small = make_config(server, out="small", judge={**BATCH, "batch_max_bytes": 500}, pairings=["sft_vs_reference"])
    with pytest.raises(ConfigError) as err:
        run_evaluation(too_small)
    assert "judge.batch_max_bytes: 500" in str(err.value) and "bytes" in str(err.value)
    assert len(server.batch_api.uploads) == 5  # nothing more uploaded


def test_batch_max_bytes_above_openais_file_limit_is_a_config_error():
    with pytest.raises(ConfigError) as err:
        build_eval_config(
            {"prompts": "p.jsonl", "judge": {"model": "m", "mode": "batch", "batch_max_bytes": 300_000_000}}
        )
    assert "judge.batch_max_bytes" in str(err.value) and "200000000" in str(err.value)


# ---------------------------------------------------------------- 9. output the judge cannot read
def test_a_malformed_output_line_is_a_counted_failure_and_the_rerun_resubmits_only_its_row(fake_server, make_config):
    server = fake_server("sensible")
    server.batch_api.corrupt_output_rows = 2  # two lines of the output file cut in half
    cfg = make_config(server, judge=BATCH, max_failed_fraction=1.0)
    report = run_evaluation(cfg)
    assert report.judge["batch"]["rows"]["rows_malformed"] == 2
    assert report.judge["batch"]["rows"]["rows_completed"] == 58
    failed = [r for r in report.table() if r["status"] != "ok"]
    assert len(failed) == 2 and all(r["status"] == "api_error" and "malformed" in r["error"] for r in failed)
    failed_prompts = {(r["pairing"], r["prompt_id"]) for r in failed}
    assert sum(p.n_api_error for p in report.pairings.values()) == len(failed_prompts)  # counted by the checks

    server.batch_api.corrupt_output_rows = 0
    again = run_evaluation(cfg)  # the batch was closed: only the two rows go in a new one
    assert server.batch_api.batches_created == 2 and _rows_of(server, 1) == 2
    assert again.pairings["policy_vs_reference"].win_rate == 0.7 and again.usage.judgments_cached == 58


def test_a_reply_whose_token_usage_is_not_a_number_is_judged_with_estimated_tokens(fake_server, make_config):
    def odd_usage(req):
        message = {"role": "assistant", "content": sensible(req).text}
        usage = {"prompt_tokens": 120, "completion_tokens": "n/a"}  # as a compatible server might send it
        return FakeReply(
            body={"object": "chat.completion", "choices": [{"index": 0, "message": message}], "usage": usage}
        )

    server = fake_server(odd_usage)
    report = run_evaluation(make_config(server, judge=BATCH, pairings=["policy_vs_reference"]))
    assert report.pairings["policy_vs_reference"].win_rate == 0.7
    assert report.usage.prompt_tokens == 20 * 120
    assert report.usage.completion_tokens == 20 * -(-len(verdict_text("A")) // 4)  # ~4 characters a token


def test_the_error_text_of_a_failed_batch_is_redacted(fake_server, make_config):
    server = fake_server("sensible")
    server.batch_api.fail_batches_with = ("invalid_request", f"key {API_KEY} has no Batch API quota")
    with pytest.raises(UntrustworthyResultError) as err:
        run_evaluation(make_config(server, judge=BATCH, pairings=["policy_vs_reference"]))
    rows = err.value.report.table()
    assert len(rows) == 20 and all("invalid_request: key *** has no Batch API quota" in r["error"] for r in rows)
    assert API_KEY not in err.value.report.judgments_path.read_text() and API_KEY not in str(err.value)


# ---------------------------------------------------------------- refusals and `content: null` in batch rows (issue 41)
def _message_reply(message: dict) -> FakeReply:
    return FakeReply(body={"model": "fake-judge", "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
                           "usage": {"prompt_tokens": 50, "completion_tokens": 5, "total_tokens": 55}})


def test_a_refused_batch_row_is_a_cached_parse_error_as_live_not_resubmitted(fake_server, make_config):
    server = fake_server(lambda req: _message_reply({"role": "assistant", "content": None,
                                                     "refusal": "I can't compare these."}))
    cfg = make_config(server, judge=BATCH, pairings=["policy_vs_reference"], max_prompts=2)
    with pytest.raises(UntrustworthyResultError) as err:
        run_evaluation(cfg)
    report = err.value.report
    assert (report.pairings["policy_vs_reference"].n_parse_error, report.pairings["policy_vs_reference"].n_api_error) \
        == (2, 0)
    assert all("refused" in row["error"] and "I can't compare" in row["error"] for row in report.table())
    assert report.judge["batch"]["rows"]["rows_refused"] == 4 and report.usage.prompt_tokens == 200  # billed
    with pytest.raises(UntrustworthyResultError):
        run_evaluation(cfg)
    assert server.batch_api.batches_created == 1  # the refusals are the judge's answer: cached, not resubmitted


def test_a_batch_row_with_null_content_and_no_refusal_is_an_uncached_api_error(fake_server, make_config):
    server = fake_server(lambda req: _message_reply({"role": "assistant", "content": None}))
    cfg = make_config(server, judge=BATCH, pairings=["policy_vs_reference"], max_prompts=2)
    with pytest.raises(UntrustworthyResultError) as err:
        run_evaluation(cfg)
    assert {row["status"] for row in err.value.report.table()} == {"api_error"}
    assert all("empty reply" in row["error"] for row in err.value.report.table())
    with pytest.raises(UntrustworthyResultError):
        run_evaluation(cfg)
    assert server.batch_api.batches_created == 2  # an empty reply is retried: the rows go in a new batch
