"""`judge.mode: batch`: the OpenAI Batch API path against the fake server's Files + Batches endpoints."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import threading
import time
from contextlib import closing
from pathlib import Path

import openai
import pytest
import yaml

from rloo_engine.evaluation import BudgetExceededError, ConfigError, EvalConfig, run_evaluation
from rloo_engine.evaluation.config import build_eval_config
from rloo_engine.evaluation.result_checks import UntrustworthyResultError
from tests.engine.helpers import repo_pythonpath
from tests.evaluation.eval_helpers import API_KEY, API_KEY_ENV, config_values, make_eval_files, recreate_first_batch

REPO = Path(__file__).resolve().parents[2]
BATCH = {"mode": "batch", "batch_poll_initial_s": 0.01, "batch_poll_max_s": 0.05}
PRICES = {"fake-judge": {"input_per_million": 2.0, "output_per_million": 8.0}}


def _rows_of(server, batch_index: int) -> int:
    return len(list(server.batch_api.batches.values())[batch_index].rows)


def test_one_batch_is_submitted_for_all_judgments_and_costs_batch_prices(fake_server, make_config):
    server = fake_server("sensible")
    report = run_evaluation(make_config(server, judge=BATCH, prices=PRICES))
    pol, sft, head = (report.pairings[n] for n in ("policy_vs_reference", "sft_vs_reference", "policy_vs_sft"))
    assert (pol.win_rate, sft.win_rate, head.win_rate) == (0.7, 0.4, 0.45)  # the live path's numbers
    assert server.batch_api.batches_created == 1 and len(server.batch_api.uploads) == 1
    assert _rows_of(server, 0) == 60  # 3 pairings x 10 prompts x 2 orders in one file
    assert server.request_count == 0  # no live chat request
    u = report.usage
    assert u.batch_prompt_tokens == u.prompt_tokens > 0 and u.batch_completion_tokens == u.completion_tokens
    assert u.cost_usd == pytest.approx((u.prompt_tokens * 2.0 + u.completion_tokens * 8.0) / 1e6 / 2)
    assert report.judge["batch"]["rows"] == {"batches_submitted": 1, "rows_completed": 60, "rows_submitted": 60}
    again = run_evaluation(make_config(server, judge=BATCH, prices=PRICES))
    assert server.batch_api.batches_created == 1 and again.usage.judgments_cached == 60  # the cache answers


def test_a_partially_expired_batch_counts_every_row_and_a_rerun_resubmits_only_the_expired(fake_server, make_config):
    server = fake_server("sensible")
    server.batch_api.expire_after_rows = 25
    cfg = make_config(server, judge=BATCH)
    with pytest.raises(UntrustworthyResultError) as err:  # 35 of 60 rows expired: far above max_failed_fraction
        run_evaluation(cfg)
    report = err.value.report
    assert report.judge["batch"]["rows"]["rows_expired"] == 35
    assert report.judge["batch"]["rows"]["rows_completed"] == 25
    rows = report.table()
    expired = [r for r in rows if r["status"] == "api_error"]
    assert len(expired) == 35 and all("expired" in r["error"] and "batch_expired" in r["error"] for r in expired)
    assert len([r for r in rows if r["status"] == "ok"]) == 25
    with closing(sqlite3.connect(report.cache_path)) as db:
        assert db.execute("SELECT COUNT(*) FROM judgments").fetchone()[0] == 25  # expired rows are not cached

    server.batch_api.expire_after_rows = None
    report = run_evaluation(cfg)
    assert server.batch_api.batches_created == 2 and _rows_of(server, 1) == 35  # only the expired ones again
    assert report.pairings["policy_vs_reference"].win_rate == 0.7
    assert report.usage.judgments_cached == 25


def test_unfinished_rows_can_be_judged_live_at_once(fake_server, make_config):
    server = fake_server("sensible")
    server.batch_api.expire_after_rows = 50
    report = run_evaluation(make_config(server, judge={**BATCH, "batch_unfinished": "live"}))
    assert all(r.n_valid == 10 for r in report.pairings.values())
    assert server.batch_api.batches_created == 1 and server.request_count == 10  # the 10 expired rows, live
    assert report.judge["batch"]["rows"]["rows_judged_live"] == 10


def test_a_run_killed_while_polling_resumes_the_same_batch_without_a_second_submission(fake_server, tmp_path, api_key):
    files = make_eval_files(tmp_path / "data")
    server = fake_server("sensible")
    server.batch_api.hold = True  # the batch stays in_progress until released
    values = config_values(files, server.base_url, tmp_path / "out", judge=BATCH)
    config_path = tmp_path / "eval.yaml"
    config_path.write_text(yaml.safe_dump(values))
    env = {**os.environ, API_KEY_ENV: API_KEY, "PYTHONPATH": repo_pythonpath()}
    proc = subprocess.Popen(
        [sys.executable, "-m", "rloo_engine.evaluation.cli", "--config", str(config_path)],
        env=env,
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None and server.batch_api.retrieves < 3:
            time.sleep(0.01)
        assert proc.poll() is None, f"the evaluation ended before it could be killed: {proc.stderr.read().decode()}"
        proc.kill()  # SIGKILL while polling
    finally:
        proc.wait(timeout=30)
    assert server.batch_api.batches_created == 1
    [batch_id] = server.batch_api.batches

    server.batch_api.hold = False
    report = run_evaluation(EvalConfig.model_validate(values))
    assert server.batch_api.batches_created == 1 and len(server.batch_api.uploads) == 1  # never submitted twice
    assert report.judge["batch"]["batch_ids"] == [batch_id]
    assert report.judge["batch"]["rows"]["rows_resumed"] == 60
    assert report.pairings["policy_vs_reference"].win_rate == 0.7 and server.request_count == 0


def test_a_run_killed_before_it_recorded_the_batch_id_finds_its_batch_by_metadata(fake_server, make_config):
    server = fake_server("sensible")
    server.batch_api.expire_after_rows = 0  # first run: every row expires, so the batch stays to be resubmitted
    cfg = make_config(server, judge=BATCH)
    with pytest.raises(UntrustworthyResultError):
        run_evaluation(cfg)
    # Put the cache in the state of a run killed between creating its (second) batch and recording its id.
    server.batch_api.expire_after_rows = None
    server.batch_api.hold = True
    with closing(sqlite3.connect(cfg.resolved_cache_path())) as db:
        token = db.execute("SELECT token FROM batches").fetchone()[0]
        ids = json.loads(db.execute("SELECT custom_ids FROM batches").fetchone()[0])
    # Create the batch the killed run had created, through the same fake endpoints and with its metadata.
    created = recreate_first_batch(server, token)
    with closing(sqlite3.connect(cfg.resolved_cache_path())) as db:
        db.execute("UPDATE batches SET batch_id = NULL, state = 'submitting'")
        db.commit()
    assert len(ids) == 60
    server.batch_api.hold = False
    report = run_evaluation(cfg)
    assert server.batch_api.batches_created == 2  # the first, and the one found by its metadata; no third
    assert report.judge["batch"]["batch_ids"] == [created.id]
    assert report.pairings["policy_vs_reference"].win_rate == 0.7


def test_the_budget_applies_before_anything_is_uploaded(fake_server, make_config):
    server = fake_server("sensible")
    prices = {"fake-judge": {"input_per_million": 1000.0, "output_per_million": 1000.0}}
    with pytest.raises(BudgetExceededError) as err:
        run_evaluation(make_config(server, judge=BATCH, prices=prices, budget_usd=1.0))
    assert "batch of 60 requests" in str(err.value)
    assert server.batch_api.uploads == [] and server.batch_api.batches_created == 0


def test_batch_mode_needs_the_openai_backend():
    with pytest.raises(ConfigError) as err:
        build_eval_config({"prompts": "p.jsonl", "judge": {"backend": "python", "function": "m:f", "mode": "batch"}})
    assert "judge.mode" in str(err.value) and "openai" in str(err.value)


def test_a_cancelled_batch_counts_its_rows_as_cancelled_and_a_rerun_resubmits_them(fake_server, make_config):
    server = fake_server("sensible")
    server.batch_api.hold = True
    cfg = make_config(server, judge=BATCH, pairings=["policy_vs_reference"])
    outcome: dict = {}

    def run() -> None:
        try:
            run_evaluation(cfg)
        except UntrustworthyResultError as err:
            outcome["report"] = err.report

    thread = threading.Thread(target=run)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.batch_api.batches and time.monotonic() < deadline:
        time.sleep(0.01)
    [batch_id] = server.batch_api.batches
    openai.OpenAI(base_url=server.base_url, api_key=API_KEY).batches.cancel(batch_id)  # e.g. from the dashboard
    thread.join(timeout=30)
    rows = outcome["report"].judge["batch"]["rows"]
    assert rows["rows_cancelled"] == 20 and rows.get("rows_completed", 0) == 0
    assert all("batch_cancelled" in r["error"] for r in outcome["report"].table())

    server.batch_api.hold = False
    report = run_evaluation(cfg)
    assert server.batch_api.batches_created == 2 and _rows_of(server, 1) == 20
    assert report.pairings["policy_vs_reference"].win_rate == 0.7
