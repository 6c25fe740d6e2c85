"""Metrics reach MLflow without ever stopping training: the step loop writes `metrics.jsonl` and says so; a thread of
this module sends the file's rows to the run, in order, each once.

A tracking server that cuts a response (`ChunkedEncodingError`), is down or restarts costs no training time and
loses nothing: a failed send is retried with backoff (1 s, doubling to 30 s) and the rows wait in the file. One
warning line when sending first fails, one when it works again (with how many rows it caught up). Each row keeps
the timestamp of its first attempt, so a request the server applied but whose answer was lost is sent again
identically and stored once. At the end, `close` waits a bounded time; what is still unsent (rows, artifacts,
the run's end status) is written to `output_dir/mlflow_pending.json` and `rloo-engine mlflow-sync <output_dir>`
sends it when the server is back (the pipeline's train task runs it after the engine exits).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

PENDING_FILE = "mlflow_pending.json"
STEP_MARKER = "epoch"  # logged in every row: its history says through which step MLflow has the rows
# MLflow's own HTTP retries would hold a request for minutes (7 retries, backoff 2); this module retries instead.
HTTP_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1", "MLFLOW_HTTP_REQUEST_TIMEOUT": "30"}
CLOSE_TIMEOUT_S = float(os.environ.get("RLOO_MLFLOW_CLOSE_TIMEOUT_S", "60"))


def stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def short(err: BaseException) -> str:
    text = str(err).splitlines()[0] if str(err) else ""
    return f"{type(err).__name__}: {text[:160]}"


class MlflowRowSender:
    """Sends the rows of `path` (metrics.jsonl) with step > `skip_through` to run `run_id`, from its own thread."""

    def __init__(self, client: Any, run_id: str, path: Path, skip_through: int, say=stderr):
        for name, value in HTTP_DEFAULTS.items():
            os.environ.setdefault(name, value)
        self.client, self.run_id, self.path, self.skip_through, self.say = client, run_id, path, skip_through, say
        self.offset = 0  # bytes of the file handled (sent, or held by MLflow already)
        self.sent_through = skip_through  # the last step sent
        self.failing_since: float | None = None
        self.last_error: BaseException | None = None
        self.caught_up = 0  # rows sent since the last failure
        self._timestamps: dict[int, int] = {}  # offset -> the row's timestamp, kept across retries
        self._wake = threading.Event()
        self._closing = False
        self._idle = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rloo-mlflow-sender", daemon=True)
        self._thread.start()

    def wrote(self) -> None:
        """A row was appended to the file: send it (without waiting)."""
        self._idle.clear()
        self._wake.set()

    def _run(self) -> None:
        delay = 1.0
        while True:
            self._wake.wait(timeout=delay if self.failing_since is not None else None)
            self._wake.clear()
            try:
                self._send_pending()
            except Exception as err:  # any failure of the server or the network: try again later
                self.last_error = err
                if self.failing_since is None:
                    self.failing_since = time.monotonic()
                    self.say(f"rloo-engine: warning: MLflow did not take step {self._next_step()}'s metrics "
                             f"({short(err)}); training goes on, metrics.jsonl keeps every step and they are sent "
                             "when the server answers again")
                delay = min(delay * 2, 30.0)
                self._idle.set()  # close() may give up on it
                continue
            if self.failing_since is not None:
                self.say(f"rloo-engine: MLflow answers again after {time.monotonic() - self.failing_since:.0f} s; "
                         f"sent the {self.caught_up} row(s) it missed")
                self.failing_since, delay = None, 1.0
            self.caught_up = 0
            self._idle.set()
            if self._closing:
                return

    def _next_step(self) -> str:
        with self.path.open("rb") as fh:
            fh.seek(self.offset)
            line = fh.readline()
        try:
            return str(json.loads(line)["step"])
        except (ValueError, KeyError):
            return "?"

    def _send_pending(self) -> None:
        from mlflow.entities import Metric

        with self.path.open("rb") as fh:
            fh.seek(self.offset)
            data = fh.read()
        for line in data.split(b"\n")[:-1]:  # complete lines only: the last may be being written
            row = json.loads(line) if line.strip() else {"step": -1}
            step = row.pop("step")
            if step > self.skip_through:
                stamp = self._timestamps.setdefault(self.offset, int(time.time() * 1000))
                batch = [Metric(k, float(v), stamp, step) for k, v in row.items()]
                for i in range(0, len(batch), 500):
                    self.client.log_batch(self.run_id, metrics=batch[i: i + 500])
                self.sent_through = step
                if self.failing_since is not None:
                    self.caught_up += 1
            self._timestamps.pop(self.offset, None)
            self.offset += len(line) + 1

    def close(self, timeout: float = CLOSE_TIMEOUT_S) -> bool:
        """Waits up to `timeout` seconds for every written row to be sent; True when all were."""
        deadline = time.monotonic() + timeout
        self.wrote()
        while time.monotonic() < deadline:
            if self._idle.wait(timeout=max(0.0, deadline - time.monotonic())) and self._all_sent():
                break
            if self.failing_since is not None and not self._all_sent():
                time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
                self.wrote()
        self._closing = True
        self._wake.set()
        return self._all_sent()

    def _all_sent(self) -> bool:
        return self.path.exists() and self.offset >= self.path.stat().st_size


def write_pending(output_dir: Path, run_id: str, tracking_uri: str, sent_through: int, status: str | None,
                  artifacts: list[str], error: BaseException | None) -> Path:
    """What `mlflow-sync` must still send, when the server did not take it by the end of the run."""
    path = output_dir / PENDING_FILE
    path.write_text(json.dumps({"run_id": run_id, "tracking_uri": tracking_uri, "sent_through": sent_through,
                                "status": status, "artifacts": artifacts,
                                "error": short(error) if error else None}, indent=1))
    return path


def sync_output_dir(output_dir: str | Path, say=stderr) -> int:
    """`rloo-engine mlflow-sync`: sends the rows, artifacts and end status a run's MLflow did not take (its
    `mlflow_pending.json`); returns 0 when everything went, 1 when the server still fails (the file stays)."""
    from mlflow.tracking import MlflowClient

    out = Path(output_dir)
    pending_path = out / PENDING_FILE
    if not pending_path.is_file():
        say(f"rloo-engine: {out} has no {PENDING_FILE}: MLflow already holds everything this run logged")
        return 0
    pending = json.loads(pending_path.read_text())
    client = MlflowClient(tracking_uri=pending["tracking_uri"])
    try:
        history = client.get_metric_history(pending["run_id"], STEP_MARKER)
        held = max((m.step for m in history), default=-1)
        sender = MlflowRowSender(client, pending["run_id"], out / "metrics.jsonl", held, say=lambda _: None)
        if not sender.close(timeout=CLOSE_TIMEOUT_S):
            raise sender.last_error or RuntimeError("the rows were not all sent")
        for artifact in pending["artifacts"]:
            _log_artifact(client, pending["run_id"], out / artifact)
        if pending["status"]:
            client.set_terminated(pending["run_id"], pending["status"])
    except Exception as err:
        say(f"rloo-engine: MLflow at {pending['tracking_uri']} still fails ({short(err)}); {PENDING_FILE} is kept: "
            "run this again later")
        return 1
    pending_path.unlink()
    say(f"rloo-engine: MLflow run {pending['run_id']} now holds every step of {out / 'metrics.jsonl'}"
        + (f", the artifacts and its {pending['status']} status" if pending["status"] else ""))
    return 0


def _log_artifact(client: Any, run_id: str, path: Path) -> None:
    if path.is_file():
        client.log_artifact(run_id, str(path))
    if path.name == "completions.jsonl":
        log_jsonl_table(client, run_id, path, "completions.json")


def log_jsonl_table(client: Any, run_id: str, path: Path, artifact_file: str) -> None:
    """A JSONL file as an MLflow table (viewable and comparable in the UI's artifact view)."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line] if path.exists() else []
    if rows:
        # Every row's keys, in first-seen order: a reward function's `log_extra` column may start mid-run.
        names = list(dict.fromkeys(k for r in rows for k in r))
        if "images" in names:  # log_multimodal: each row's first prompt image, shown beside its prompt
            names.insert(names.index("prompt") + 1 if "prompt" in names else 0, "image")
        table = {k: [_table_image(path.parent, r.get("images")) if k == "image" else r.get(k) for r in rows]
                 for k in names}
        client.log_table(run_id, table, artifact_file)


def _table_image(folder: Path, names: list[str] | None):
    """The first of a row's saved prompt images as an `mlflow.Image` (a table cell the UI shows), or None."""
    if not names or not (folder / names[0]).is_file():
        return None
    import mlflow
    from PIL import Image

    with Image.open(folder / names[0]) as picture:
        return mlflow.Image(picture.copy())
