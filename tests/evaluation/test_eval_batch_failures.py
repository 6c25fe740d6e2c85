"""`judge.mode: batch` failure paths (issue 23): refused endpoints, the budget across batches, double
submissions, file sizes, and output the judge cannot read. Each test failed on the code before its fix."""

from __future__ import annotations

import asyncio
import traceback

import pytest
import yaml

from rloo_engine.evaluation import JudgeEndpointError
from rloo_engine.evaluation.budget import SpendTracker
from rloo_engine.evaluation.cache import JudgmentCache
from rloo_engine.evaluation.cli import main as evaluate_main
from rloo_engine.evaluation.judges import build_judge
from rloo_engine.evaluation.judges.base import SlotPair
from rloo_engine.evaluation.templates import load_template
from tests.evaluation.eval_helpers import API_KEY

BATCH = {"mode": "batch", "batch_poll_initial_s": 0.01, "batch_poll_max_s": 0.05}


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
    assert evaluate_main(["--config", str(config_file), "--no_progress"]) == 1  # "the endpoint refused": exit 1
    stderr = capsys.readouterr().err
    assert stderr.startswith("error: judge batch:") and "HTTP 404" in stderr and API_KEY not in stderr
