"""MLflow bookkeeping: one parent run per flow run, one child run per stage, run status, params and links.

Everything goes through `MlflowClient` with explicit run ids, never the fluent "active run": the
training engine logs into the same runs from another process, and a run's status is owned by whoever
created it. A Prefect retry of a stage reopens that stage's run, so a flow run always has exactly
one child run per stage.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from rloo_engine.config_base import ConfigError

# Where this code runs from: a git checkout (editable install) names its commit; an installed wheel has none.
_SOURCE_DIR = Path(__file__).resolve().parents[2]
MLFLOW_PARAM_LIMIT = 6000  # characters of one param value
# Dict-valued options that are one value to the user (passed on whole), not sections of further options.
_WHOLE_DICT_OPTIONS = ("generation_kwargs", "chat_template_kwargs", "extra_body", "env")

TAG_FLOW_RUN = "prefect.flow_run_id"
TAG_STAGE = "rloo.stage"
TAG_PARENT = "mlflow.parentRunId"


class RunRef(BaseModel):
    """A pointer to an MLflow run, passed between tasks (never a client or an active-run object)."""

    tracking_uri: str
    experiment_id: str
    run_id: str

    @property
    def url(self) -> str | None:
        return run_url(self.tracking_uri, self.experiment_id, self.run_id)


def resolve_tracking_uri(configured: str | None) -> str:
    """`tracking.tracking_uri`, else $MLFLOW_TRACKING_URI; never MLflow's implicit ./mlruns default."""
    uri = configured or os.environ.get("MLFLOW_TRACKING_URI")
    if not uri:
        raise ConfigError(
            "tracking.tracking_uri: not set and MLFLOW_TRACKING_URI is not in the environment; point it at the "
            "MLflow server (e.g. http://mlflow:5000), usually as a job variable of the work pool"
        )
    return uri


def client(tracking_uri: str):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)


def run_url(tracking_uri: str, experiment_id: str, run_id: str) -> str | None:
    """The MLflow UI page of a run, when the tracking URI is a server."""
    if not tracking_uri.startswith(("http://", "https://")):
        return None
    return f"{tracking_uri.rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}"


def git_sha() -> str:
    """Commit of the code that runs (env GIT_COMMIT wins, for images built without .git)."""
    if os.environ.get("GIT_COMMIT"):
        return os.environ["GIT_COMMIT"]
    try:
        sha = subprocess.run(
            ["git", "-C", str(_SOURCE_DIR), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(_SOURCE_DIR), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def experiment_id(mlflow_client: Any, name: str) -> str:
    exp = mlflow_client.get_experiment_by_name(name)
    if exp is not None:
        return exp.experiment_id
    try:
        return mlflow_client.create_experiment(name)
    except Exception:  # created concurrently by another flow run
        exp = mlflow_client.get_experiment_by_name(name)
        if exp is None:
            raise
        return exp.experiment_id


def _find_run(mlflow_client: Any, exp_id: str, tags: dict[str, str]) -> Any | None:
    clauses = " and ".join(f"tags.`{k}` = '{v}'" for k, v in tags.items())
    found = mlflow_client.search_runs([exp_id], filter_string=clauses, max_results=1)
    return found[0] if found else None


def parent_run(tracking_uri: str, experiment: str, flow_run_id: str, run_name: str, tags: dict[str, str]) -> RunRef:
    """The flow run's parent MLflow run: created once, found again when the flow run is retried."""
    c = client(tracking_uri)
    exp_id = experiment_id(c, experiment)
    run = _find_run(c, exp_id, {TAG_FLOW_RUN: flow_run_id, TAG_STAGE: "pipeline"})
    if run is None:
        run = c.create_run(exp_id, run_name=run_name, tags={TAG_FLOW_RUN: flow_run_id, TAG_STAGE: "pipeline", **tags})
    else:
        c.update_run(run.info.run_id, status="RUNNING")
    return RunRef(tracking_uri=tracking_uri, experiment_id=exp_id, run_id=run.info.run_id)


def child_run(parent: RunRef, stage: str) -> tuple[RunRef, int]:
    """This stage's run under `parent` and its attempt number (a retry reopens the same run)."""
    c = client(parent.tracking_uri)
    run = _find_run(c, parent.experiment_id, {TAG_PARENT: parent.run_id, TAG_STAGE: stage})
    if run is None:
        parent_tags = c.get_run(parent.run_id).data.tags
        # `train-<flow run name>`, not `train`: a model version's Source Run and a search across flow runs show the
        # run name alone. The stage is the `rloo.stage` tag.
        flow_run_name = parent_tags.get("mlflow.runName", "").rsplit("/", 1)[-1]
        run = c.create_run(
            parent.experiment_id,
            run_name=f"{stage}-{flow_run_name}" if flow_run_name else stage,
            tags={TAG_PARENT: parent.run_id, TAG_STAGE: stage, TAG_FLOW_RUN: parent_tags.get(TAG_FLOW_RUN, "")},
        )
        attempt = 1
    else:
        attempt = int(run.data.tags.get("rloo.attempts", "1")) + 1
        c.update_run(run.info.run_id, status="RUNNING")
    c.set_tag(run.info.run_id, "rloo.attempts", str(attempt))
    return RunRef(tracking_uri=parent.tracking_uri, experiment_id=parent.experiment_id, run_id=run.info.run_id), attempt


WORKER_DIED = ("its Prefect worker died, and the flow-run process with it; with the automations of "
               "deployments/automations/ the same flow run runs again and reopens this run")


@contextmanager
def run_status(ref: RunRef) -> Iterator[None]:
    """Ends `ref` FINISHED on success, FAILED on an error, KILLED on cancellation (SIGTERM, Ctrl-C). A SIGTERM
    that comes because the worker that started this process died is no cancellation: FAILED, tagged with why
    (the re-run automation, deployments/automations/, runs the flow run again and reopens the run)."""
    started = time.monotonic()
    status = "FAILED"
    parent = os.getppid()
    try:
        yield
        status = "FINISHED"
    except Exception:
        status = "FAILED"
        raise
    except BaseException:
        status = "KILLED"
        if os.getppid() != parent:  # re-parented: the worker is gone
            status = "FAILED"
            client(ref.tracking_uri).set_tag(ref.run_id, "rloo.end_reason", WORKER_DIED)
        raise
    finally:
        c = client(ref.tracking_uri)
        try:
            c.log_metric(ref.run_id, "duration_s", time.monotonic() - started)
        finally:
            c.set_terminated(ref.run_id, status)


def end_runs_of_crashed_flow_run(flow: Any, flow_run: Any, state: Any) -> list[str]:
    """Prefect `on_crashed` hook: ends FAILED every MLflow run of `flow_run` still RUNNING; returns their ids.

    A flow-run process killed outright (SIGKILL, OOM, a lost node) runs no `finally`, so its parent and
    stage runs would stay RUNNING forever. The worker notices the dead process, marks the flow run
    Crashed and runs this hook in its own process, with the tracking URI from the flow run's
    parameters, its job variables or the worker's environment.
    """
    params = flow_run.parameters or {}
    overrides = params.get("overrides") or {}
    section = (params.get("cfg") or {}).get("tracking") or {}
    job_env = (flow_run.job_variables or {}).get("env") or {}
    uri = overrides.get("tracking.tracking_uri") or section.get("tracking_uri") or job_env.get(
        "MLFLOW_TRACKING_URI") or os.environ.get("MLFLOW_TRACKING_URI")
    if not uri:
        return []
    c = client(uri)
    experiments = [e.experiment_id for e in c.search_experiments()]
    runs = c.search_runs(experiments, filter_string=f"tags.`{TAG_FLOW_RUN}` = '{flow_run.id}' and "
                                                    "attributes.status = 'RUNNING'") if experiments else []
    reason = f"the Prefect flow run crashed: {getattr(state, 'message', None) or state.name}"
    for run in runs:
        c.set_tag(run.info.run_id, "rloo.end_reason", reason)
        c.set_terminated(run.info.run_id, "FAILED")
    return [run.info.run_id for run in runs]


@contextmanager
def stage_run(parent: RunRef, stage: str) -> Iterator[RunRef]:
    """Opens (or, on a retry, reopens) the stage's child run and ends it with the stage's outcome."""
    ref, _ = child_run(parent, stage)
    with run_status(ref):
        yield ref


def flat_params(values: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """A config dump as stable dotted names (`train.learning_rate`, `sft.source`, ...) and MLflow param strings."""
    flat: dict[str, str] = {}
    for key, value in values.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value and key not in _WHOLE_DICT_OPTIONS:
            flat.update(flat_params(value, name + "."))
        else:
            flat[name] = param_text(value)[:MLFLOW_PARAM_LIMIT]
    return flat


def param_text(value: Any) -> str:
    """A param's text, the same in every run: a string as it is, anything else as JSON (`["my.mod:fn"]`, `true`,
    `null`), never Python's repr (`['my.mod:fn']`, `True`, `None`)."""
    return value if isinstance(value, str) else json.dumps(value, default=str)


def log_params(ref: RunRef, params: dict[str, Any]) -> None:
    """Logs params in batches; values are strings cut to MLflow's limit."""
    from mlflow.entities import Param

    items = [Param(k, param_text(v)[:MLFLOW_PARAM_LIMIT]) for k, v in params.items()]
    c = client(ref.tracking_uri)
    for i in range(0, len(items), 100):
        c.log_batch(ref.run_id, params=items[i : i + 100])


def log_metrics(ref: RunRef, metrics: dict[str, float | int | None], step: int = 0) -> None:
    """Logs finite numeric metrics in one batch; None values are skipped (a missing rate is not a 0)."""
    import math

    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    batch = [
        Metric(k, float(v), now, step)
        for k, v in metrics.items()
        if v is not None and not isinstance(v, bool) and math.isfinite(float(v))
    ]
    batch += [Metric(k, float(v), now, step) for k, v in metrics.items() if isinstance(v, bool)]
    c = client(ref.tracking_uri)
    for i in range(0, len(batch), 500):
        c.log_batch(ref.run_id, metrics=batch[i : i + 500])


def set_tags(ref: RunRef, tags: dict[str, Any]) -> None:
    from mlflow.entities import RunTag

    client(ref.tracking_uri).log_batch(ref.run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])


def log_artifact(ref: RunRef, path: str | Path, artifact_path: str | None = None) -> None:
    if Path(path).exists():
        client(ref.tracking_uri).log_artifact(ref.run_id, str(path), artifact_path)


def warning_tags(warnings: list[str]) -> dict[str, str]:
    """{`evaluation.warning.<pairing>.<kind>`: message} for MLflow tags (values cut to MLflow's 5000 characters)."""
    kinds = {
        "position bias": "position_bias",
        "judge noise": "judge_noise",
        "length-controlled win rate not estimable": "lc_not_estimable",
        "length-controlled": "lc_gap",
        "have no verdict": "failed",
        "lack a completion": "missing",
    }
    tags: dict[str, str] = {}
    for warning in warnings:
        pairing, _, text = warning.partition(": ")
        kind = next((k for marker, k in kinds.items() if marker in text), "other")
        tags[f"evaluation.warning.{pairing}.{kind}"] = warning[:5000]
    return tags
