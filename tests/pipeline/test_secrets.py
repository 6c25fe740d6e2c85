"""Secrets come from Prefect Secret blocks or the environment at run time and reach only their consumer."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from rloo_engine.config_base import ConfigError
from rloo_engine.pipeline.config import build_pipeline_config
from rloo_engine.pipeline.tracking import RunRef, flat_params
from rloo_engine.services import scoped_env
from tasks.evaluate import _judge_secret
from tasks.secrets import secret_env
from tasks.train import _training_env
from tests.pipeline.pipeline_helpers import tiny_pipeline_config

pytestmark = pytest.mark.slow

ASSETS = {k: Path(f"/x/{k}") for k in ("sft", "reward_model", "train_prompts", "eval_prompts")}


def openai_judged_config(**launch):
    values = tiny_pipeline_config(ASSETS, Path("/runs"))
    values["evaluation"]["judge"] = {"backend": "openai", "model": "gpt-4o", "api_key_env": "JUDGE_KEY"}
    values["evaluation"]["api_key_secret"] = "judge-key"
    values["launch"].update(launch)
    return build_pipeline_config(values)


def test_secret_blocks_feed_the_training_process_and_the_judge_only(services, monkeypatch):
    from prefect.blocks.system import Secret

    monkeypatch.setenv("JUDGE_KEY", "sk-from-the-worker-env")
    cfg = openai_judged_config(secret_env={"HF_TOKEN": "hf-token"}, env={"NCCL_DEBUG": "INFO"})
    run = RunRef(tracking_uri="http://mlflow:5000", experiment_id="1", run_id="abc")
    with services.prefect_settings():
        Secret(value="hf_secret_value").save("hf-token", overwrite=True)
        Secret(value="sk-from-the-block").save("judge-key", overwrite=True)
        env = _training_env(cfg, run)
        judge = _judge_secret(cfg)
        with pytest.raises(ConfigError, match=r"launch.secret_env.HF_TOKEN: Prefect Secret block 'missing-block'"):
            secret_env({"HF_TOKEN": "missing-block"}, "launch.secret_env")

    assert env["HF_TOKEN"] == "hf_secret_value"
    assert "JUDGE_KEY" not in env  # the judge's key never reaches the training process
    assert (
        env["NCCL_DEBUG"] == "INFO"
        and env["MLFLOW_RUN_ID"] == "abc"
        and env["MLFLOW_TRACKING_URI"] == "http://mlflow:5000"
    )
    assert judge == {"JUDGE_KEY": "sk-from-the-block"}
    # The evaluation sees the block's key only while it runs; the worker's own value comes back afterwards.
    with scoped_env(judge):
        assert os.environ["JUDGE_KEY"] == "sk-from-the-block"
    assert os.environ["JUDGE_KEY"] == "sk-from-the-worker-env"
    assert "sk-from-the-block" not in cfg.model_dump_json() and "hf_secret_value" not in str(flat_params(cfg.model_dump(mode="json")))
