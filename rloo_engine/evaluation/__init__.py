"""Win-rate evaluation: pairwise LLM judging with position-bias control, caching, rate limits and confidence intervals.

Public API (stable; the pipeline's evaluation task calls it):

    from rloo_engine.evaluation import EvalConfig, run_evaluation, EvalReport
    report = run_evaluation(cfg, policy_path=..., sft_path=..., output_dir=...)

See docs/evaluation.md. Never imports Prefect.
"""

from rloo_engine.evaluation.config import EvalConfig, EvalGenerationConfig, JudgeConfig, TokenPrice, load_eval_config
from rloo_engine.evaluation.errors import BudgetExceededError, ConfigError, EvaluationError, JudgeEndpointError
from rloo_engine.evaluation.report import EvalReport, PairedDifference, PairingResult, Usage
from rloo_engine.evaluation.runner import run_evaluation

__all__ = [
    "EvalConfig",
    "JudgeConfig",
    "EvalGenerationConfig",
    "TokenPrice",
    "load_eval_config",
    "run_evaluation",
    "EvalReport",
    "PairingResult",
    "PairedDifference",
    "Usage",
    "ConfigError",
    "EvaluationError",
    "JudgeEndpointError",
    "BudgetExceededError",
]
