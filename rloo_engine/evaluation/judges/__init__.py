"""Judge backends behind one interface, `await judge.judge(pairs) -> judgments`; `build_judge` picks one."""

from __future__ import annotations

import os
from typing import Any

from rloo_engine.config_base import ConfigError
from rloo_engine.evaluation.budget import SpendTracker
from rloo_engine.evaluation.config import JudgeConfig
from rloo_engine.evaluation.judges.base import Judge, Judgment, SlotPair
from rloo_engine.evaluation.templates import JudgeTemplate

__all__ = ["Judge", "Judgment", "SlotPair", "build_judge", "read_api_key"]


def read_api_key(cfg: JudgeConfig) -> str | None:
    """The API key from the environment variable named by `api_key_env` (None when that is null)."""
    if cfg.api_key_env is None:
        return None
    key = os.environ.get(cfg.api_key_env)
    if not key:
        raise ConfigError(
            f"judge.api_key_env: environment variable {cfg.api_key_env} is not set; export the judge's API key "
            "there, or set api_key_env: null for a server that needs none"
        )
    return key


def build_judge(
    cfg: JudgeConfig, template: JudgeTemplate | None, spend: SpendTracker, batch_store: Any = None
) -> Judge:
    """The judge for `cfg.backend`. Call inside the event loop that will use it (the HTTP client binds to it).

    `template` is needed by the openai and hf backends; the others compare answers without a prompt.
    `batch_store` (the JudgmentCache) records Batch API submissions, for `mode: batch`.
    """
    if cfg.backend in ("openai", "hf") and template is None:
        raise ValueError(f"judge.backend {cfg.backend!r} needs a judge template")
    if cfg.backend == "openai" and cfg.mode == "batch":
        from rloo_engine.evaluation.judges.openai_batch import OpenAIBatchJudge

        if batch_store is None:
            raise ValueError("judge.mode 'batch' needs a batch store (the judgment cache) to record submissions")
        return OpenAIBatchJudge(cfg, template, spend, read_api_key(cfg), batch_store)  # type: ignore[arg-type]
    if cfg.backend == "openai":
        from rloo_engine.evaluation.judges.openai_judge import OpenAIJudge

        return OpenAIJudge(cfg, template, spend, read_api_key(cfg))  # type: ignore[arg-type]
    if cfg.backend == "hf":
        from rloo_engine.evaluation.judges.hf_judge import HFJudge

        return HFJudge(cfg, template)  # type: ignore[arg-type]
    if cfg.backend == "reward_model":
        from rloo_engine.evaluation.judges.reward_model_judge import RewardModelJudge

        return RewardModelJudge(cfg)
    from rloo_engine.evaluation.judges.python_judge import PythonJudge

    return PythonJudge(cfg)
