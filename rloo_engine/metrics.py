"""Metric sinks: `output_dir/metrics.jsonl` always, MLflow when configured; rank 0 only.

MLflow is used through `MlflowClient` against an explicit run id, never the fluent active run:
the launching task owns the run's lifecycle (FINISHED / FAILED / KILLED), the engine only logs.
While training, MLflow's system-metrics monitor samples the node (CPU, memory, disk, network, and
GPUs when `pynvml` is installed) into the same run as `system/*`, so a slow run shows why;
`MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING=false` turns it off, `MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL`
sets the period (10 s).

Each step is in every sink once, however often the run was killed and resumed: on start the JSONL files
are cut back to the start step (a torn last line dropped), and MLflow is not sent a step it already
holds (a resume redoes steps bit-exactly, so the values it has are the ones it would get). A run the
engine created itself is named in `output_dir/mlflow_run.json`; a resume continues it, and a fresh run
ends it FAILED if its process died without ending it.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

RUN_FILE = "mlflow_run.json"
STEP_MARKER = "epoch"  # logged at every logging step: its history says which steps MLflow already has


class MetricsLogger:
    def __init__(self, output_dir: str | Path, enabled: bool, run_name: str | None = None, params: dict | None = None,
                 continue_run: bool = False):
        self.enabled = enabled
        self.path = Path(output_dir) / "metrics.jsonl"
        self.client = None
        self.run_id: str | None = None
        self.owns_run = False
        self.system_metrics = None
        self.mlflow_has_through = 0  # MLflow already holds steps up to this one
        if enabled:
            self._connect_mlflow(run_name, params or {}, continue_run)

    def _connect_mlflow(self, run_name: str | None, params: dict[str, Any], continue_run: bool) -> None:
        run_id = os.environ.get("MLFLOW_RUN_ID")
        if not run_id and not os.environ.get("MLFLOW_TRACKING_URI"):
            return
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient()
        if run_id:
            self.run_id = run_id
        else:
            self.owns_run = True
            previous = self._previous_run()
            if previous is not None and continue_run:
                self.run_id = previous.info.run_id
                self.client.update_run(self.run_id, status="RUNNING")
            else:
                if previous is not None and previous.info.status == "RUNNING":
                    # We hold the output_dir lock, so the run that opened it is dead.
                    self.client.set_tag(previous.info.run_id, "rloo.end_reason",
                                        "its process died without ending it; a fresh run started in its output_dir")
                    self.client.set_terminated(previous.info.run_id, "FAILED")
                name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "rloo-engine")
                exp = self.client.get_experiment_by_name(name)
                exp_id = exp.experiment_id if exp else self.client.create_experiment(name)
                self.run_id = self.client.create_run(exp_id, run_name=run_name).info.run_id
                self.log_params(params)
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self.path.with_name(RUN_FILE).write_text(json.dumps(
                    {"run_id": self.run_id, "tracking_uri": self.client.tracking_uri}))
        history = self.client.get_metric_history(self.run_id, STEP_MARKER)
        self.mlflow_has_through = max((m.step for m in history), default=0)
        self.system_metrics = _start_system_metrics(self.run_id)

    def _previous_run(self):
        """The run an earlier engine run in this output_dir created on this tracking server, if it still exists."""
        try:
            info = json.loads(self.path.with_name(RUN_FILE).read_text())
            if info["tracking_uri"] != self.client.tracking_uri:
                return None
            run = self.client.get_run(info["run_id"])
        except Exception:  # no file, a torn file, a deleted run
            return None
        return None if run.info.lifecycle_stage == "deleted" else run

    def log_params(self, params: dict[str, Any]) -> None:
        if self.client is None:
            return
        from mlflow.entities import Param

        items = [Param(k, str(v)[:6000]) for k, v in params.items()]
        for i in range(0, len(items), 100):
            self.client.log_batch(self.run_id, params=items[i : i + 100])

    def truncate_after(self, step: int) -> None:
        """On start, drop what an earlier run logged after `step` (metrics, completions): each step once."""
        if not self.enabled:
            return
        for path in (self.path, self.path.with_name("completions.jsonl")):
            truncate_jsonl(path, step)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        clean = {k: float(v) for k, v in metrics.items() if v is not None and math.isfinite(float(v))}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as fh:
            fh.write(json.dumps({"step": step, **clean}) + "\n")
        if self.client is not None and step > self.mlflow_has_through:
            from mlflow.entities import Metric

            now = int(time.time() * 1000)
            batch = [Metric(k, v, now, step) for k, v in clean.items()]
            for i in range(0, len(batch), 500):
                self.client.log_batch(self.run_id, metrics=batch[i : i + 500])

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        if self.enabled and self.client is not None and Path(path).exists():
            self.client.log_artifact(self.run_id, str(path), artifact_path)

    def log_table(self, jsonl_path: str | Path, artifact_file: str) -> None:
        """Logs a JSONL file as an MLflow table (viewable and comparable in the UI's artifact view)."""
        path = Path(jsonl_path)
        if not (self.enabled and self.client is not None and path.exists()):
            return
        rows = [json.loads(line) for line in path.read_text().splitlines() if line]
        if rows:
            columns = {k: [r.get(k) for r in rows] for k in rows[0]}
            self.client.log_table(self.run_id, columns, artifact_file)

    def finish(self, status: str = "FINISHED") -> None:
        """Ends the run only if the engine created it; a run handed in via MLFLOW_RUN_ID stays open."""
        if self.system_metrics is not None:
            self.system_metrics.finish()  # flushes the last samples
            self.system_metrics = None
        if self.client is not None and self.owns_run:
            self.client.set_terminated(self.run_id, status)


def truncate_jsonl(path: Path, step: int) -> None:
    """Keeps the rows of `path` with `step` <= step; a torn row (the writer was killed mid-line) is dropped."""
    if not path.exists():
        return
    kept, torn = [], 0
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line) if line.strip() else None
        except json.JSONDecodeError:
            torn += 1
            continue
        if row is not None and row["step"] <= step:
            kept.append(line)
    if torn:
        print(f"rloo-engine: {path}: dropped {torn} torn line(s) left by a killed run", file=sys.stderr)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(ln + "\n" for ln in kept))
    os.replace(tmp, path)


def _start_system_metrics(run_id: str):
    """MLflow's system-metrics monitor on `run_id` (a retry continues its step count); None when disabled."""
    if os.environ.get("MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING", "true").lower() in ("false", "0", "no", "off"):
        return None
    try:
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

        monitor = SystemMetricsMonitor(
            run_id, resume_logging=True, tracking_uri=os.environ.get("MLFLOW_TRACKING_URI") or None
        )
        monitor.start()
        return monitor
    except Exception as err:  # e.g. psutil missing: training goes on without them
        print(f"rloo-engine: system metrics are not logged: {type(err).__name__}: {err}", file=sys.stderr)
        return None
