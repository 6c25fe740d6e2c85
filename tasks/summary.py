"""Task `publish_summary`: a pipeline run's summary (`rloo_engine/pipeline/run_summary.py`) published as a Prefect
markdown artifact (key `rlhf-summary`), `summary.json`/`summary.md` and metrics on the parent MLflow run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from rloo_engine.pipeline import tracking
from rloo_engine.pipeline.input_checkpoints import CheckpointInfo
from rloo_engine.pipeline.run_summary import build_summary, headline, render_markdown
from rloo_engine.pipeline.stage_results import EvalSummary, Promotion, RewardInfo, TrainStageResult
from rloo_engine.pipeline.tracking import RunRef


@task(name="publish_summary", cache_policy=NO_CACHE)
def publish_summary(
    title: str,
    run_dir: str,
    parent: RunRef,
    sft: CheckpointInfo | None = None,
    reward: RewardInfo | None = None,
    trained: TrainStageResult | None = None,
    evaluation: EvalSummary | None = None,
    promotion: Promotion | None = None,
    error: str | None = None,
) -> dict[str, Any]:
    """Builds the run summary, publishes it (Prefect artifact, MLflow parent run) and returns it."""
    summary = build_summary(run_dir, parent, sft, reward, trained, evaluation, promotion, error)
    markdown = render_markdown(title, summary)
    create_markdown_artifact(
        key="rlhf-summary", markdown=markdown, description=f"{title}: stages, win rates, promotion"
    )
    out = Path(run_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    (out / "summary.md").write_text(markdown)
    tracking.log_artifact(parent, out / "summary.json")
    tracking.log_artifact(parent, out / "summary.md")
    if trained and trained.reward_curve:
        tracking.log_artifact(parent, trained.reward_curve)
    metrics: dict[str, float | None] = {
        f"train/{k}": v
        for k, v in (summary.get("train") or {}).items()
        if isinstance(v, (int, float)) and not isinstance(v, bool)
    }
    for name, r in (summary.get("evaluation") or {}).items():
        metrics.update({f"{name}/{k}": r.get(k) for k in ("win_rate", "ci_low", "ci_high", "lc_win_rate")})
    tracking.log_metrics(parent, metrics)
    # The run's description in the MLflow UI: the result, readable without opening anything.
    tracking.set_tags(parent, {"mlflow.note.content": headline(summary)})
    return summary


def publish_failure_summary(title: str, run_dir: str, parent: RunRef, error: BaseException, **results: Any) -> None:
    """Publishes what finished before `error`; never masks the error with a failure of its own."""
    try:
        publish_summary(title, run_dir, parent, error=f"{type(error).__name__}: {error}", **results)
    except Exception as publish_error:  # the stage's error is the one that matters
        get_run_logger().warning("could not publish the failure summary: %s", publish_error)


