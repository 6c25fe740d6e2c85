"""Task `open_pipeline_run`: the flow run's output directory and its parent MLflow run.

Everything a flow run writes lives under `<output_root>/<flow-run-id>/`, so two concurrent runs never
share or clobber files, and a retried flow run finds its own checkpoints again. The parent MLflow
run is tagged with the Prefect flow run, deployment and git commit, and holds the resolved config
as params with stable dotted names (`train.learning_rate`, ...) for side-by-side comparison.
"""

from __future__ import annotations

from pathlib import Path

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.runtime import deployment, flow_run
from pydantic import BaseModel

from rloo_engine.pipeline import tracking
from rloo_engine.pipeline.config import PipelineConfig
from rloo_engine.pipeline.tracking import RunRef


class PipelineRun(BaseModel):
    flow_run_id: str
    flow_run_name: str
    deployment: str | None
    dir: str
    parent: RunRef


@task(name="open_pipeline_run", cache_policy=NO_CACHE)
def open_pipeline_run(cfg: PipelineConfig, flow_name: str) -> PipelineRun:
    """Creates `<output_root>/<flow-run-id>/` and the parent MLflow run (found again on a flow retry)."""
    logger = get_run_logger()
    run_id, run_name = str(flow_run.id), str(flow_run.name)
    deployment_name = f"{flow_name}/{deployment.name}" if deployment.name else None
    run_dir = Path(cfg.output_root).expanduser().resolve() / run_id
    run_dir.mkdir(parents=True, exist_ok=True)
    uri = tracking.resolve_tracking_uri(cfg.tracking.tracking_uri)
    parent = tracking.parent_run(
        uri,
        cfg.tracking.experiment,
        run_id,
        run_name=f"{flow_name}/{run_name}",
        tags={
            "prefect.flow": flow_name,
            "prefect.flow_run_name": run_name,
            "prefect.deployment": deployment_name or "none",
            "mlflow.source.git.commit": tracking.git_sha(),
            "rloo.output_dir": str(run_dir),
        },
    )
    tracking.log_params(parent, tracking.flat_params(cfg.model_dump(mode="json")))
    config_path = run_dir / "pipeline_config.yaml"
    config_path.write_text(cfg.to_yaml())
    tracking.log_artifact(parent, config_path)
    logger.info("output dir %s; MLflow run %s", run_dir, parent.url or parent.run_id)
    return PipelineRun(
        flow_run_id=run_id, flow_run_name=run_name, deployment=deployment_name, dir=str(run_dir), parent=parent
    )


def check_crash_reruns(cfg: PipelineConfig) -> None:
    """A flow run that runs again (rescheduled after a crash, or `prefect flow-run retry`) says so; past
    `launch.crash_reruns` re-runs it stops, so a run that crashes every time does not loop."""
    reruns = int(flow_run.run_count or 1) - 1
    if reruns == 0:
        return
    if reruns > cfg.launch.crash_reruns:
        raise RuntimeError(f"launch.crash_reruns: this flow run has run {reruns + 1} times (crashed and rescheduled); "
                           f"more than {cfg.launch.crash_reruns} re-runs are refused. Find why it crashes (its worker's "
                           "log, the node's memory), then `prefect flow-run retry` it or start a new one")
    print(f"re-run {reruns} of this flow run (it crashed): continuing in its own output directory; finished stages "
          "are not redone, training resumes from its newest checkpoint")
