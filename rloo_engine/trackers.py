"""The file-based trackers of `report_to` beside MLflow: TensorBoard and Weights & Biases, as transformers feeds them.

TensorBoard gets each metric under its own name (`reward`, `kl`, `clip_ratio/region_mean` ...) at the optimizer step,
in event files under `output_dir/runs/`, as transformers' `TensorBoardCallback` writes them. W&B gets them with
transformers' `train/` prefix (`train/reward`), against a `train/global_step` axis, as its `WandbCallback` logs them;
the project is `WANDB_PROJECT` (default `huggingface`, transformers' default) and the files go under
`output_dir/wandb/` unless `WANDB_DIR` says otherwise.

Each step is in each tracker once, however often the run was killed and resumed: TensorBoard is opened with a
purge step (events an earlier run wrote after the start step are dropped when the files are read), and the W&B run
is continued by the id in `output_dir/wandb_run.json`, which also records the last step it was sent.
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path
from typing import Any

WANDB_RUN_FILE = "wandb_run.json"


class TensorBoardTracker:
    def __init__(self, output_dir: Path, params: dict[str, Any], start_step: int):
        from torch.utils.tensorboard import SummaryWriter

        # purge_step: a reader drops events at steps >= it that earlier writers left, so a redone step shows once.
        self.writer = SummaryWriter(log_dir=str(output_dir / "runs"), purge_step=start_step + 1)
        if start_step <= 0:
            self.writer.add_text("config", json.dumps(params, indent=1, default=str))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for name, value in metrics.items():
            self.writer.add_scalar(name, value, step)
        self.writer.flush()

    def finish(self, status: str) -> None:
        self.writer.close()


class WandbTracker:
    def __init__(self, output_dir: Path, run_name: str | None, params: dict[str, Any], start_step: int):
        import wandb

        self.run_file = output_dir / WANDB_RUN_FILE
        previous = _read_json(self.run_file) if start_step > 0 else None
        run_id = previous["run_id"] if previous else uuid.uuid4().hex[:8]  # W&B's own id format: 8 of [a-z0-9]
        self.logged_through = previous.get("logged_through", 0) if previous else 0
        output_dir.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "huggingface"), name=run_name, id=run_id, resume="allow",
            config=params, dir=None if os.environ.get("WANDB_DIR") else str(output_dir),
        )
        self.run.define_metric("train/global_step")
        self.run.define_metric("*", step_metric="train/global_step", step_sync=True)
        self._record()

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if step <= self.logged_through:  # a resume redoes steps bit-exactly: the run already has these values
            return
        self.run.log({**{f"train/{k}": v for k, v in metrics.items()}, "train/global_step": step})
        self.logged_through = step
        self._record()

    def finish(self, status: str) -> None:
        self.run.finish(exit_code=0 if status == "FINISHED" else 1)

    def _record(self) -> None:
        self.run_file.write_text(json.dumps({"run_id": self.run.id, "logged_through": self.logged_through}))


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):  # no file, or a torn one
        return None


def open_tracker(name: str, output_dir: Path, run_name: str | None, params: dict[str, Any], start_step: int):
    """The tracker `report_to` calls `name` (`tensorboard` or `wandb`), opened at `start_step`."""
    if name == "tensorboard":
        return TensorBoardTracker(output_dir, params, start_step)
    return WandbTracker(output_dir, run_name, params, start_step)
