"""The engine alone (`pip install rloo-pipeline`, no `[pipeline]`): it trains and evaluates with a python judge
without MLflow, Prefect, openai, aiohttp, matplotlib, psutil or DeepSpeed, and says what to install when a run
asks for MLflow. Checked here with those packages hidden from the dev venv (tests/engine/scripts/without_modules.py);
scripts/test_engine_install.sh installs the bare engine into a new venv once in CI and runs the same commands."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import yaml

from tests.engine.helpers import repo_pythonpath

REPO = Path(__file__).resolve().parents[2]
PIPELINE_ONLY = "mlflow,prefect,openai,aiohttp,matplotlib,psutil,deepspeed"


def engine(*args: str, env_extra: dict[str, str] | None = None, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    env.update({"PYTHONPATH": repo_pythonpath(), "OMP_NUM_THREADS": "1", **(env_extra or {})})
    cmd = [sys.executable, str(REPO / "tests/engine/scripts/without_modules.py"), PIPELINE_ONLY, "--",
           "-m", "rloo_engine", *args]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def test_the_engine_trains_and_evaluates_without_the_pipeline_packages(tmp_path):
    assert engine("tiny-assets", str(tmp_path / "a"), cwd=tmp_path).returncode == 0
    train = ["train", "--model_name_or_path", str(tmp_path / "a/policy"),
             "--dataset_name", str(tmp_path / "a/prompts.jsonl"),
             "--reward_funcs", "rloo_engine.reward_functions:char_fraction", "--num_generations", "2",
             "--per_device_train_batch_size", "2", "--max_completion_length", "4", "--max_steps", "2", "--disable_tqdm"]
    proc = engine(*train, "--output_dir", str(tmp_path / "out"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "MLflow run    none (set MLFLOW_TRACKING_URI and pip install 'rloo-pipeline[mlflow]'" in proc.stdout

    (tmp_path / "eval.yaml").write_text(yaml.safe_dump({
        "prompts": str(tmp_path / "a/prompts.jsonl"), "max_prompts": 8, "pairings": ["policy_vs_sft"],
        "policy_model_path": str(tmp_path / "out/final"), "sft_model_path": str(tmp_path / "a/policy"),
        "generation": {"max_new_tokens": 4, "dtype": "float32", "device": "cpu"},
        "judge": {"backend": "python", "function": "rloo_engine.demo.toy_task:gold_judge"},
        "output_dir": str(tmp_path / "eval")}))
    proc = engine("evaluate", "--config", str(tmp_path / "eval.yaml"), "--no_progress", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "policy_vs_sft        win" in proc.stdout and (tmp_path / "eval/results.json").is_file()

    # Asked to log to MLflow (the variable set, report_to's default) without it: one line, before any model loads.
    proc = engine(*train, "--output_dir", str(tmp_path / "out2"), cwd=tmp_path,
                  env_extra={"MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}"})
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        "error: report_to: mlflow logs to MLflow when MLFLOW_TRACKING_URI is set, as it is here, but the mlflow "
        "package is not installed (the engine alone does not bring it); pip install 'rloo-pipeline[mlflow]', "
        "or report_to: none")
    assert not (tmp_path / "out2" / "final").exists()
