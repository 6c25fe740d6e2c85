"""Crash and resume, budgets, and the API key never leaving the environment."""

from __future__ import annotations

import logging
import os
import sqlite3
import subprocess
import sys
import time
from contextlib import closing
from pathlib import Path

import pytest
import yaml

from rloo_engine.evaluation import BudgetExceededError, EvalConfig, JudgeEndpointError, run_evaluation
from rloo_engine.evaluation.cli import main as evaluate_main
from tests.engine.helpers import repo_pythonpath
from tests.evaluation.eval_helpers import API_KEY, API_KEY_ENV, config_values, make_eval_files

REPO = Path(__file__).resolve().parents[2]


def _cached_pairs(cache_path: Path) -> set[tuple[str, str]]:
    """(slot A answer, slot B answer) of every cached judgment; empty while the cache is still being created."""
    with closing(sqlite3.connect(cache_path)) as db:
        try:
            return set(db.execute("SELECT answer_a, answer_b FROM judgments").fetchall())
        except sqlite3.OperationalError:  # the evaluation has not created the table yet
            return set()


@pytest.mark.slow
def test_rerun_after_a_killed_run_repeats_no_finished_judgment(fake_server, tmp_path, api_key):
    files = make_eval_files(tmp_path / "data", n=20)
    server = fake_server("sensible", latency_s=0.05)
    values = config_values(
        files, server.base_url, tmp_path / "out", pairings=["policy_vs_reference"], judge={"max_concurrency": 2}
    )
    config_path = tmp_path / "eval.yaml"
    config_path.write_text(yaml.safe_dump(values))
    cache_path = tmp_path / "out" / "judge_cache.sqlite"

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
        while time.monotonic() < deadline and proc.poll() is None:
            if cache_path.exists() and len(_cached_pairs(cache_path)) >= 10:
                break
            time.sleep(0.01)
        assert proc.poll() is None, f"the evaluation ended before it could be killed: {proc.stderr.read().decode()}"
        proc.kill()  # SIGKILL: no cleanup, no flush, like a crashed or cancelled task
    finally:
        proc.wait(timeout=30)
    time.sleep(0.2)  # let requests that were in flight at the kill reach the server's log

    finished = _cached_pairs(cache_path)
    sent_before_rerun = server.request_count
    assert 10 <= len(finished) < 40 and sent_before_rerun < 40

    report = run_evaluation(EvalConfig.model_validate(values))

    counts = server.first_ask_counts()
    assert all(counts[pair] == 1 for pair in finished)  # finished judgments were never asked again
    assert max(counts.values()) <= 2  # at most the in-flight ones were asked twice
    assert server.request_count - sent_before_rerun == 40 - len(finished)
    r = report.pairings["policy_vs_reference"]
    assert (r.n_valid, r.n_win, r.n_loss) == (20, 14, 6)
    assert report.usage.judgments_cached == len(finished)


def test_budget_stops_before_it_is_exceeded_and_a_rerun_continues(fake_server, make_config):
    server = fake_server("sensible")
    prices = {"fake-judge": {"input_per_million": 1000.0, "output_per_million": 1000.0}}  # $0.001 per token
    cfg = make_config(server, pairings=["policy_vs_reference"], prices=prices, budget_usd=1.5, judge={"max_tokens": 64})
    with pytest.raises(BudgetExceededError) as err:
        run_evaluation(cfg)
    assert "budget_usd" in str(err.value) and "rerun" in str(err.value)
    with closing(sqlite3.connect(cfg.resolved_cache_path())) as db:
        done, tokens = db.execute("SELECT COUNT(*), SUM(prompt_tokens + completion_tokens) FROM judgments").fetchone()
    assert 0 < done < 20
    assert tokens * 0.001 <= 1.5  # spent within the budget
    assert server.request_count == done  # nothing was sent and thrown away
    assert not (Path(cfg.output_dir) / "results.json").exists()  # no partial results pretending to be final

    finished = _cached_pairs(cfg.resolved_cache_path())
    report = run_evaluation(cfg.model_copy(update={"budget_usd": 100.0}))
    assert report.pairings["policy_vs_reference"].n_valid == 10
    assert all(server.first_ask_counts()[pair] == 1 for pair in finished)
    assert report.usage.cost_usd <= 100.0


def test_the_api_key_appears_in_no_output_cache_or_log(fake_server, make_config, caplog, capsys, tmp_path):
    caplog.set_level(logging.DEBUG)  # every logger, the openai and HTTP clients' included
    ok = run_evaluation(make_config(fake_server("malformed_then_ok"), out="ok"))
    flaky = run_evaluation(
        make_config(fake_server("rate_limited"), out="flaky", pairings=["sft_vs_reference"], max_prompts=2)
    )
    unauthorized = fake_server("unauthorized")
    with pytest.raises(JudgeEndpointError) as err:
        run_evaluation(make_config(unauthorized, out="denied"))
    assert unauthorized.requests and unauthorized.requests[0].authorization == f"Bearer {API_KEY}"  # it was used...
    config_file = tmp_path / "cli.yaml"
    config_file.write_text(
        yaml.safe_dump(
            config_values(make_eval_files(tmp_path / "cli_data"), unauthorized.base_url, tmp_path / "cli_out")
        )
    )
    assert evaluate_main(["--config", str(config_file), "--no_progress"]) == 2  # refused: fix the key

    # ... and is nowhere else: not in any file written, the cache (with its WAL), logs, output or errors
    written = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert ok.cache_path in written and flaky.results_path in written
    for path in written:
        assert API_KEY.encode() not in path.read_bytes(), path
    captured = capsys.readouterr()
    assert "401" in captured.err
    for text in (caplog.text, captured.out, captured.err, str(err.value), repr(err.value), repr(ok), str(ok.config)):
        assert API_KEY not in text
