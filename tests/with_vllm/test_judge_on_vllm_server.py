"""The openai judge against a real vLLM server (not the project's fake): a tiny Qwen2.5-shaped chat model served by
vLLM, its chat template applied by vLLM, its verdict line constrained by vLLM's structured outputs (a random
model writes no verdict line of its own)."""

from __future__ import annotations

import sqlite3
from contextlib import closing

import pytest

from rloo_engine.evaluation import EvalConfig, run_evaluation
from rloo_engine.testing.tiny_chat_models import build_chat_model
from rloo_engine.testing.vllm_server import Server
from tests.evaluation.eval_helpers import API_KEY, API_KEY_ENV, config_values, make_eval_files


@pytest.fixture(scope="module")
def judge_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("judge")
    # the judge template is long in a 320-token byte-level vocabulary: 2048 positions, not the usual 512
    model = build_chat_model(root / "qwen-chat", "qwen", hidden=64, num_attention_heads=2, num_key_value_heads=1,
                             max_position_embeddings=2048)
    srv = Server(model, root / "server.log")
    yield srv
    srv.stop()


def test_the_openai_judge_judges_through_a_real_vllm_server(judge_server, tmp_path, monkeypatch):
    monkeypatch.setenv(API_KEY_ENV, API_KEY)  # vLLM started without --api-key accepts any bearer token
    files = make_eval_files(tmp_path / "data")
    served = judge_server.get("/v1/models")["data"][0]["id"]
    cfg = EvalConfig.model_validate(config_values(files, f"{judge_server.url}/v1", tmp_path / "out", judge={
        "model": served, "temperature": 0.0, "timeout_s": 60.0,
        "max_tokens": 32, "extra_body": {"structured_outputs": {"choice": ["Preferred: A", "Preferred: B"]}}}))
    report = run_evaluation(cfg)

    # 3 pairings x 10 prompts x 2 orders, every reply a verdict the parser read
    assert report.usage.requests == 60 == report.usage.judgments_made
    for result in report.pairings.values():
        assert result.n == result.n_valid == 10 and result.n_parse_error == result.n_api_error == 0
    rows = report.table()
    assert {row["raw_verdict"] for row in rows} <= {"Preferred: A", "Preferred: B"} and {row["status"] for row in rows} == {"ok"}
    assert {row["served_model"] for row in rows} == {served}  # the model id vLLM reported
    assert report.usage.prompt_tokens > 0 and report.usage.completion_tokens > 0  # vLLM's usage block was read
    with closing(sqlite3.connect(tmp_path / "out" / "judge_cache.sqlite")) as db:
        assert {m for (m,) in db.execute("SELECT DISTINCT served_model FROM judgments")} == {served}

    again = run_evaluation(cfg)  # every verdict from the cache: no request reaches the server
    assert again.usage.requests == 0
    assert {n: r.win_rate for n, r in again.pairings.items()} == {n: r.win_rate for n, r in report.pairings.items()}
