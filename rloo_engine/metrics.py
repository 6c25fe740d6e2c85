"""Metric sinks: `output_dir/metrics.jsonl` always, and the trackers `report_to` names (MLflow here, TensorBoard and
W&B in `rloo_engine/trackers.py`); rank 0 only. And the reduction of a logging window's values over its
micro-batches and the processes (`window_values`, `reduce_window`).

MLflow is used through `MlflowClient` against an explicit run id, never the fluent active run:
the launching task owns the run's lifecycle (FINISHED / FAILED / KILLED), the engine only logs.
While training, MLflow's system-metrics monitor samples the node (CPU, memory, disk, network, and
GPUs when `pynvml` is installed) into the same run as `system/*`, so a slow run shows why;
`MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING=false` turns it off, `MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL`
sets the period (10 s).

Each step is in every sink once, however often the run was killed and resumed: on start the JSONL files
are cut back to the start step (a torn last line dropped), and MLflow is not sent a step it already
holds (a resume redoes steps bit-exactly, so the values it has are the ones it would get). MLflow gets the rows
of `metrics.jsonl` from a thread of its own (`mlflow_sender.py`), so a tracking server that fails or is down never
stops training; what it never took is sent by `rloo-engine mlflow-sync`. A run the
engine created itself is named in `output_dir/mlflow_run.json`; a resume continues it, and a fresh run
ends it FAILED if its process died without ending it.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import Any

from rloo_engine.mlflow_sender import (
    PENDING_FILE,
    STEP_MARKER,
    MlflowRowSender,
    log_jsonl_table,
    short,
    write_pending,
)

RUN_FILE = "mlflow_run.json"
# a finished run's files, uploaded at its end (completion_images/: a folder, with log_multimodal)
ARTIFACTS = ("config.yaml", "metrics.jsonl", "completions.jsonl", "completion_images")

# Metrics that are extremes over the logging window and the processes, not means of per-micro-batch extremes.
EXTREMES = {"vllm/logprob_diff_max": max, "bf16_decoding/logprob_diff_max": max, "sampling/importance_sampling_ratio/max": max,
            "sampling/importance_sampling_ratio/min": min}
# Per-process extremes TRL also logs beside the mean over processes: metric -> (name logged, reduction).
PROCESS_EXTREMES = {"completions/min_length": ("completions/min_length", min),
                    "completions/min_terminated_length": ("completions/min_terminated_length", min),
                    "clip_ratio/low": ("clip_ratio/low_min", min),
                    "completions/max_length": ("completions/max_length", max),
                    "completions/max_terminated_length": ("completions/max_terminated_length", max),
                    "clip_ratio/high": ("clip_ratio/high_max", max)}


def nanmean(values: list[float]) -> float:
    finite = [v for v in values if not math.isnan(v)]
    return sum(finite) / len(finite) if finite else float("nan")


def window_value(name: str, values: list[float]) -> float:
    """One process's value of `name` over a logging window: the mean, or the extreme for `EXTREMES` (NaN ignored)."""
    if name not in EXTREMES:
        return nanmean(values)
    finite = [v for v in values if not math.isnan(v)]
    return EXTREMES[name](finite) if finite else float("nan")


def window_values(window: dict[str, list[float]]) -> tuple[list[str], list[float]]:
    """(sorted names, this process's value of each): what every process contributes to `reduce_window`."""
    names = sorted(window)
    return names, [window_value(k, window[k]) for k in names]


def reduce_window(names: list[str], everyone: list[list[float]]) -> dict[str, float]:
    """The logged metrics from every process's `window_values` (`everyone`: one row per process): the mean over
    processes (NaN ignored), extremes for `EXTREMES`, TRL's per-process min/max beside the means, and the clip
    fractions under TRL's `clip_ratio/*_mean` names."""
    columns = {k: [row[i] for row in everyone] for i, k in enumerate(names)}
    metrics = {k: window_value(k, v) if k in EXTREMES else nanmean(v) for k, v in columns.items()}
    for k, (logged, extreme) in PROCESS_EXTREMES.items():
        if k in columns:
            metrics[logged] = extreme(columns[k])
    for k in ("low", "high", "region"):
        if f"clip_ratio/{k}" in metrics:
            metrics[f"clip_ratio/{k}_mean"] = metrics.pop(f"clip_ratio/{k}")
    return metrics


class MetricsLogger:
    def __init__(self, output_dir: str | Path, enabled: bool, run_name: str | None = None, params: dict | None = None,
                 continue_run: bool = False, trackers: list[str] | tuple[str, ...] = ("mlflow",)):
        """`trackers`: RLOOConfig.trackers(); MLflow connects here, the others open at the start step
        (`truncate_after`)."""
        self.enabled = enabled
        self.path = Path(output_dir) / "metrics.jsonl"
        self.run_name, self.params = run_name, params or {}
        self.other_names = [t for t in trackers if t != "mlflow"]
        self.others: list = []
        self.client = None
        self.run_id: str | None = None
        self.owns_run = False
        self.system_metrics = None
        self.sender: MlflowRowSender | None = None
        self.mlflow_has_through = -1  # MLflow already holds steps up to this one (0: the eval_on_start row)
        if enabled and "mlflow" in trackers:
            self._connect_mlflow(run_name, self.params, continue_run)

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
        self.mlflow_has_through = max((m.step for m in history), default=-1)
        self.system_metrics = _start_system_metrics(self.run_id)
        (self.path.parent / PENDING_FILE).unlink(missing_ok=True)  # what this run sends now covers it

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
        """On start, drop what an earlier run logged after `step` (metrics, completions): each step once. Then opens
        the other trackers from `step` (they drop or skip what they already hold after it themselves)."""
        if not self.enabled:
            return
        for path in (self.path, self.path.with_name("completions.jsonl")):
            truncate_jsonl(path, step)
        from rloo_engine.trackers import open_tracker

        self.others = [open_tracker(name, self.path.parent, self.run_name, self.params, step)
                       for name in self.other_names]
        if self.client is not None:  # after the cut: it sends the file's rows MLflow lacks, a gap before `step` too
            self.path.touch()
            self.sender = MlflowRowSender(self.client, self.run_id, self.path, self.mlflow_has_through)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        clean = {k: float(v) for k, v in metrics.items() if v is not None and math.isfinite(float(v))}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as fh:
            fh.write(json.dumps({"step": step, **clean}) + "\n")
        if self.sender is not None:
            self.sender.wrote()  # MLflow gets it from the sender's thread: the step loop never waits for it
        for tracker in self.others:
            tracker.log(step, clean)

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        if self.enabled and self.client is not None and Path(path).is_dir():
            self.client.log_artifacts(self.run_id, str(path), artifact_path or Path(path).name)
        elif self.enabled and self.client is not None and Path(path).exists():
            self.client.log_artifact(self.run_id, str(path), artifact_path)

    def log_table(self, jsonl_path: str | Path, artifact_file: str) -> None:
        """Logs a JSONL file as an MLflow table (viewable and comparable in the UI's artifact view)."""
        if self.enabled and self.client is not None:
            log_jsonl_table(self.client, self.run_id, Path(jsonl_path), artifact_file)

    def log_completions(self, step: int, samples: list[dict], num_to_print: int,
                        images: list[list] | None = None) -> None:
        """Appends this step's samples to `completions.jsonl` and prints the first `num_to_print` (as TRL prints).
        A `log_extra` value JSON cannot hold (a numpy scalar, an object) is written as its `str`. `images`: each
        sample's prompt images (`log_multimodal`), saved once per prompt as `completion_images/step-N/*.png` and
        named in the row's `images`."""
        from tqdm.auto import tqdm

        rows = [{"step": step, **r} for r in samples]
        saved: dict[int, list[str]] = {}  # a prompt's image list (shared by its G samples) -> its files
        for row, prompt_images in zip(rows, images or []):
            if id(prompt_images) not in saved:
                names = [f"completion_images/step-{step}/prompt-{len(saved)}-{j}.png" for j in range(len(prompt_images))]
                (self.path.parent / "completion_images" / f"step-{step}").mkdir(parents=True, exist_ok=True)
                for name, picture in zip(names, prompt_images):
                    picture.save(self.path.parent / name)
                saved[id(prompt_images)] = names
            row["images"] = saved[id(prompt_images)]
        with (self.path.parent / "completions.jsonl").open("a") as fh:
            fh.writelines(json.dumps(r, default=str) + "\n" for r in rows)
        for r in rows[:num_to_print]:
            tqdm.write(f"[step {r['step']}] reward={r['reward']:+.3f} adv={r['advantage']:+.3f} "
                       f"{r['prompt'][-60:]!r} -> {r['completion'][:120]!r}")

    def finish_run(self) -> None:
        """The end of a finished run: its config, metrics and completions as artifacts, then the run FINISHED."""
        if self.enabled:
            self.finish(artifacts=ARTIFACTS)

    def finish(self, status: str = "FINISHED", artifacts: tuple[str, ...] = ()) -> None:
        """Sends what is left (bounded wait), the artifacts, then ends the run only if the engine created it (a run
        handed in via MLFLOW_RUN_ID stays open). What MLflow does not take goes to `mlflow_pending.json`."""
        if self.system_metrics is not None:
            self.system_metrics.finish()  # flushes the last samples
            self.system_metrics = None
        for tracker in self.others:
            tracker.finish(status)
        self.others = []
        if self.client is None:
            return
        sent = self.sender.close() if self.sender is not None else True
        error = None if sent else self.sender.last_error
        unsent = []
        for name in artifacts if sent else ():
            try:
                self.log_artifact(self.path.parent / name)
                if name == "completions.jsonl":
                    self.log_table(self.path.parent / name, "completions.json")
            except Exception as err:  # the server failed: `mlflow-sync` uploads it later
                unsent.append(name)
                error = err
        unsent += [] if sent else list(artifacts)
        end = status if self.owns_run else None
        if sent and not unsent and end:
            try:
                self.client.set_terminated(self.run_id, end)
                end = None
            except Exception as err:
                error = err
        if not sent or unsent or end:
            through = self.sender.sent_through if self.sender is not None else self.mlflow_has_through
            write_pending(self.path.parent, self.run_id, self.client.tracking_uri, through, end, unsent, error)
            missing = [f"the steps after {through}" if not sent else "", ", ".join(unsent), f"the {end} status" if end
                       else ""]
            print(f"rloo-engine: warning: MLflow at {self.client.tracking_uri} did not take "
                  f"{'; '.join(m for m in missing if m)} ({short(error) if error else 'no answer'}); metrics.jsonl "
                  f"holds every step: `rloo-engine mlflow-sync {self.path.parent}` sends them when it answers again",
                  file=sys.stderr)


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
