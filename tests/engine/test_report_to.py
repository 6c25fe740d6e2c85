"""`report_to` sends each logging step's metrics to the trackers it names, with the real packages: TensorBoard event
files, a W&B offline run, MLflow; `none` to none of them (metrics.jsonl is written whatever it says)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import mlflow
import pytest

from rloo_engine.trainer import RLOOTrainer
from tests.engine.helpers import read_metrics, tiny_config, train_until_crash


def tensorboard_events(log_dir: Path, tag: str) -> list:
    """The scalar events of `tag` as TensorBoard reads them (purged steps dropped)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir))
    events.Reload()
    return events.Scalars(tag)


def tensorboard_scalars(log_dir: Path, tag: str) -> dict[int, float]:
    return {e.step: e.value for e in tensorboard_events(log_dir, tag)}


def tensorboard_steps(log_dir: Path, tag: str) -> list[int]:
    return [e.step for e in tensorboard_events(log_dir, tag)]


def wandb_history(out: Path) -> list[dict]:
    """The history rows of the offline run under `out/wandb/` (one directory per start), from its `.wandb` logs.

    The log is LevelDB's log format behind a 7-byte `:W&B` header: 32 KiB blocks of records, each a 7-byte header
    (crc32, length, type: 1 whole, 2 first, 3 middle, 4 last part) and a piece of a serialized `Record` proto.
    wandb 0.31 reads it in its Go core only, so the test reads it here.
    """
    from wandb.proto import wandb_internal_pb2

    rows = []
    for log in sorted(out.glob("wandb/offline-run-*/run-*.wandb")):
        rows += _history_rows(log.read_bytes(), wandb_internal_pb2.Record)
    return rows


def _history_rows(data: bytes, record_type) -> list[dict]:
    assert data[:4] == b":W&B"
    block, pos, parts, rows = 32768, 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        parts += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = record_type()
            record.ParseFromString(parts)
            parts = b""
            if record.WhichOneof("record_type") == "history":
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                             for item in record.history.item})
    return rows


@pytest.fixture
def wandb_offline(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_PROJECT", "rloo-tests")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_DIR", raising=False)


def test_a_list_reports_each_step_to_mlflow_tensorboard_and_wandb(tmp_path, qwen2_model, wandb_offline, monkeypatch):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "report-to")
    cfg = tiny_config(tmp_path, qwen2_model, max_steps=3, report_to=["mlflow", "tensorboard", "wandb"])
    RLOOTrainer(cfg).train()
    out = Path(cfg.output_dir)
    rows = read_metrics(out)
    expected = {r["step"]: r["reward"] for r in rows}
    assert sorted(expected) == [1, 2, 3]

    assert tensorboard_scalars(out / "runs", "reward") == pytest.approx(expected)
    assert set(tensorboard_scalars(out / "runs", "clip_ratio/region_mean")) == {1, 2, 3}  # TRL's names

    history = wandb_history(out)
    assert {int(h["train/global_step"]): h["train/reward"] for h in history} == pytest.approx(expected)
    assert "train/kl" in history[0] and "train/clip_ratio/region_mean" in history[0]  # transformers' `train/` prefix
    assert json.loads((out / "wandb_run.json").read_text())["logged_through"] == 3

    client = mlflow.MlflowClient(uri)
    run_id = json.loads((out / "mlflow_run.json").read_text())["run_id"]
    assert {m.step: m.value for m in client.get_metric_history(run_id, "reward")} == pytest.approx(expected)


def test_none_reports_to_no_tracker_even_with_mlflow_configured(tmp_path, qwen2_model, monkeypatch):
    db = tmp_path / "mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{db}")
    cfg = tiny_config(tmp_path, qwen2_model, max_steps=2, report_to="none")
    assert cfg.report_to == [] and cfg.trackers() == []
    RLOOTrainer(cfg).train()
    out = Path(cfg.output_dir)
    assert [r["step"] for r in read_metrics(out)] == [1, 2]
    assert not db.exists() and not (out / "mlflow_run.json").exists()  # MLflow was never opened
    assert not (out / "runs").exists() and not (out / "wandb").exists()


def test_tensorboard_alone_leaves_mlflow_out(tmp_path, qwen2_model, monkeypatch):
    db = tmp_path / "mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{db}")
    cfg = tiny_config(tmp_path, qwen2_model, max_steps=2, report_to="tensorboard")
    RLOOTrainer(cfg).train()
    assert set(tensorboard_scalars(Path(cfg.output_dir) / "runs", "kl")) == {1, 2}
    assert not db.exists()


def test_report_to_all_resolves_to_the_installed_trackers_and_lists_are_checked(tmp_path, qwen2_model):
    from rloo_engine.config_base import ConfigError

    cfg = tiny_config(tmp_path, qwen2_model, report_to="all")
    assert cfg.report_to == ["all"] and "mlflow" in cfg.trackers()
    assert tiny_config(tmp_path, qwen2_model).trackers() == ["mlflow"]  # the default: MLflow when configured
    with pytest.raises(ConfigError, match="`all` and `none` stand alone"):
        tiny_config(tmp_path, qwen2_model, report_to=["none", "wandb"])
    with pytest.raises(ConfigError, match="report_to"):
        tiny_config(tmp_path, qwen2_model, report_to="comet_ml")


def test_a_resumed_run_shows_each_step_once_in_tensorboard_and_wandb(tmp_path, qwen2_model, wandb_offline, monkeypatch):
    """Killed after logging step 3 with checkpoint-2 on disk: the resume redoes step 3, and neither tracker shows
    it twice (TensorBoard purges it, W&B was told the run already has it)."""
    common = dict(max_steps=4, save_steps=2, report_to=["tensorboard", "wandb"])
    train_until_crash(tmp_path, qwen2_model, monkeypatch, 3, **common)
    cfg = tiny_config(tmp_path, qwen2_model, **common, resume_from_checkpoint="latest")
    RLOOTrainer(cfg).train()
    out = Path(cfg.output_dir)
    expected = {r["step"]: r["reward"] for r in read_metrics(out)}
    assert sorted(expected) == [1, 2, 3, 4]
    assert tensorboard_scalars(out / "runs", "reward") == pytest.approx(expected)
    assert sorted(tensorboard_steps(out / "runs", "reward")) == [1, 2, 3, 4]  # step 3 once, not twice
    history = wandb_history(out)
    assert sorted(int(h["train/global_step"]) for h in history) == [1, 2, 3, 4]
    assert {int(h["train/global_step"]): h["train/reward"] for h in history} == pytest.approx(expected)
