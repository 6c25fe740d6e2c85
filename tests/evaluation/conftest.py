"""Fixtures of the evaluation tests: the local OpenAI-compatible server, the eval set, config builders."""

from __future__ import annotations

from typing import Any

import pytest

from rloo_engine.evaluation import EvalConfig
from rloo_engine.testing.fake_openai_server import FakeOpenAIServer
from tests.evaluation.eval_helpers import API_KEY, API_KEY_ENV, config_values, make_eval_files


@pytest.fixture
def eval_files(tmp_path):
    return make_eval_files(tmp_path / "data")


@pytest.fixture
def api_key(monkeypatch) -> str:
    monkeypatch.setenv(API_KEY_ENV, API_KEY)
    return API_KEY


@pytest.fixture
def fake_server():
    """Starts FakeOpenAIServer(behaviour, latency_s) on a free local port; stops them all at teardown."""
    servers: list[FakeOpenAIServer] = []

    def start(behaviour="sensible", latency_s: float = 0.0) -> FakeOpenAIServer:
        server = FakeOpenAIServer(behaviour, latency_s).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


@pytest.fixture
def make_config(eval_files, tmp_path, api_key):
    def build(server: FakeOpenAIServer, out: str = "out", **overrides: Any) -> EvalConfig:
        return EvalConfig.model_validate(config_values(eval_files, server.base_url, tmp_path / out, **overrides))

    return build
