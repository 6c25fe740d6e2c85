"""Errors of the evaluation library; each message names what failed and what to do about it."""

from __future__ import annotations

from rloo_engine.config_base import ConfigError

__all__ = ["ConfigError", "EvaluationError", "JudgeEndpointError", "BudgetExceededError", "redact"]


class EvaluationError(RuntimeError):
    """An evaluation could not finish; nothing is reported as a result (finished judgments stay cached)."""


class JudgeEndpointError(EvaluationError):
    """The judge endpoint refused the request in a way retrying cannot fix (401, 403, 404)."""


class BudgetExceededError(EvaluationError):
    """The next judge call could take the spend past `budget_usd`; the run stopped before making it."""


def redact(text: str, secret: str | None) -> str:
    """`text` with every occurrence of `secret` replaced, so server messages that echo a key are safe to show."""
    if not secret:
        return text
    return text.replace(secret, "***")
