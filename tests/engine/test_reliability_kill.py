"""SIGKILL at seeded random moments (inside checkpoint writes too), then resume: <= save_steps lost, nothing twice."""

from __future__ import annotations

import json
import random
import re
import signal
import subprocess
import sys
from pathlib import Path

import mlflow
import torch
from transformers import AutoModelForCausalLM

from rloo_engine.run.fault_injection import CHECKPOINT_POINTS, KILL_ENV, KILL_POINTS, STEP_POINTS
from tests.engine.helpers import read_metrics, tiny_config
from tests.engine.test_cli_and_processes import REPO
from tests.engine.test_reliability import engine_env, write_config

MAX_STEPS, SAVE_STEPS, KILLS, SEED = 10, 2, 5, 10  # seed 10: kills at every kind of point


def kill_moments(seed: int) -> list[tuple[int, str]]:
    """KILLS (step, point) pairs in increasing step order, one of them inside a checkpoint write."""
    rng = random.Random(seed)
    inside = rng.choice(range(SAVE_STEPS, MAX_STEPS, SAVE_STEPS))
    others = rng.sample([s for s in range(1, MAX_STEPS) if s != inside], KILLS - 1)
    moments = [(inside, rng.choice(CHECKPOINT_POINTS))]
    moments += [(s, rng.choice(KILL_POINTS if s % SAVE_STEPS == 0 else STEP_POINTS)) for s in others]
    return sorted(moments)


def engine(cfg_file: Path, uri: str | None, **env: str) -> subprocess.CompletedProcess:
    tracking = {"MLFLOW_TRACKING_URI": uri, "MLFLOW_EXPERIMENT_NAME": "kill"} if uri else {}
    return subprocess.run([sys.executable, "-m", "rloo_engine", "train", "--config", str(cfg_file)], cwd=REPO,
                          env=engine_env(**tracking, **env),
                          capture_output=True, text=True, timeout=300)


def test_sigkill_at_random_moments_then_resume_equals_the_straight_run(tmp_path, qwen2_model):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = mlflow.MlflowClient(uri)
    client.create_experiment("kill", artifact_location=str(tmp_path / "artifacts"))
    common = dict(max_steps=MAX_STEPS, save_steps=SAVE_STEPS, log_completions=True, beta=0.05,
                  resume_from_checkpoint="latest")
    straight = tiny_config(tmp_path / "straight", qwen2_model, **common)
    proc = engine(write_config(straight, tmp_path / "straight.yaml"), None)
    assert proc.returncode == 0, proc.stderr[-3000:]

    cfg = tiny_config(tmp_path / "killed", qwen2_model, **common)
    cfg_file = write_config(cfg, tmp_path / "killed.yaml")
    out = Path(cfg.output_dir)
    moments = kill_moments(SEED)
    assert len(moments) == KILLS and {p for _, p in moments} == set(KILL_POINTS)
    resumed_at = 0
    for step, point in moments + [(None, None)]:
        proc = engine(cfg_file, uri, **({KILL_ENV: f"{step}:{point}"} if step else {}))
        found = re.search(r"resumed from .*checkpoint-(\d+) at step (\d+)", proc.stderr)
        start = int(found.group(2)) if found else 0
        assert start >= resumed_at, f"resumed at {start}, behind the previous resume at {resumed_at}"
        if step is None:
            assert proc.returncode == 0, proc.stderr[-3000:]
            break
        assert proc.returncode == -signal.SIGKILL, (step, point, proc.stderr[-3000:])
        assert f"{KILL_ENV}={step}:{point}" in proc.stderr
        resumed_at = start
        # The next run starts from the newest complete checkpoint: at most save_steps steps are redone.
        newest = max((int(p.name.split("-")[1]) for p in out.glob("checkpoint-*")), default=0)
        assert step - newest <= SAVE_STEPS, (step, point, newest)

    # Every sink holds each step once.
    assert [r["step"] for r in read_metrics(out)] == list(range(1, MAX_STEPS + 1))
    rows = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines() if line]
    assert sorted(r["step"] for r in rows) == sorted(s for s in range(1, MAX_STEPS + 1) for _ in range(8))
    [run] = client.search_runs([client.get_experiment_by_name("kill").experiment_id])
    assert run.info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "reward")] == list(range(1, MAX_STEPS + 1))
    assert not list(out.glob(".tmp-*"))

    # The same weights, and the same metrics, as the run that was never killed.
    a = AutoModelForCausalLM.from_pretrained(Path(straight.output_dir) / "final")
    b = AutoModelForCausalLM.from_pretrained(out / "final")
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(pa, pb), f"parameter {name} differs after {KILLS} kills"
    for ra, rb in zip(read_metrics(straight.output_dir), read_metrics(out)):
        assert ra["reward"] == rb["reward"] and ra["kl"] == rb["kl"], ra["step"]
