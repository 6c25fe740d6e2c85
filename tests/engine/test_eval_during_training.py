"""Evaluation during training (`eval_strategy`, `eval_steps`, `eval_on_start`, `per_device_eval_batch_size`,
`num_generations_eval`): TRL's metric names with `eval_`, deterministic, without effect on training, resumable."""

from __future__ import annotations

import os
import subprocess
import sys

import datasets
import mlflow
import pytest
import torch

from rloo_engine import RLOOConfig, RLOOTrainer
from rloo_engine.config_base import ConfigError
from tests.engine.helpers import prompt_file, read_metrics, repo_pythonpath, target_token_fraction, train_until_crash
from tests.engine.helpers import tiny_config as engine_config

EVAL = dict(eval_strategy="steps", eval_steps=2, eval_on_start=True, per_device_eval_batch_size=4,
            num_generations_eval=2)


def tiny_config(tmp_path, model, **overrides):
    return engine_config(tmp_path, model, beta=0.05, **{**EVAL, **overrides})


def eval_rows(out) -> list[dict]:
    return [{k: v for k, v in r.items() if k.startswith("eval_") and "runtime" not in k and "per_second" not in k}
            | {"step": r["step"]} for r in read_metrics(out) if "eval_reward" in r]


def train_rows(out) -> list[dict]:
    return [{k: r[k] for k in ("step", "reward", "loss", "kl")} for r in read_metrics(out) if "reward" in r]


def held_out(tmp_path, n=6) -> datasets.Dataset:
    return datasets.load_dataset("json", data_files=str(prompt_file(tmp_path / "held_out", n=n)), split="train")


def test_eval_logs_trls_names_and_leaves_training_as_it_was(tmp_path, qwen2_model):
    plain = RLOOTrainer(engine_config(tmp_path / "plain", qwen2_model, beta=0.05))
    plain.train()
    evaluated = RLOOTrainer(tiny_config(tmp_path / "eval", qwen2_model), eval_dataset=held_out(tmp_path))
    evaluated.train()
    rows = eval_rows(evaluated.cfg.output_dir)
    assert [r["step"] for r in rows] == [0, 2, 4]  # on start, then every eval_steps
    names = set(rows[0])
    assert {"eval_reward", "eval_reward_std", "eval_rewards/target_token_fraction/mean",
            "eval_rewards/target_token_fraction/std", "eval_kl", "eval_frac_reward_zero_std",
            "eval_completions/mean_length", "eval_completions/clipped_ratio",
            "eval_completions/mean_terminated_length"} <= names
    assert rows[0]["eval_kl"] == 0.0  # nothing trained yet: the policy is its reference
    timed = [r for r in read_metrics(evaluated.cfg.output_dir) if "eval_runtime" in r]
    assert all(r["eval_runtime"] > 0 and r["eval_samples_per_second"] > 0 for r in timed)
    # Evaluating samples in its own RNG: training is exactly what it is without it.
    assert train_rows(evaluated.cfg.output_dir) == train_rows(plain.cfg.output_dir)
    final = evaluated.acc.unwrap_model(evaluated.policy).state_dict()
    assert all(torch.equal(v, final[k]) for k, v in plain.acc.unwrap_model(plain.policy).state_dict().items())
    # ... and the same seed gives the same evaluations.
    again = RLOOTrainer(tiny_config(tmp_path / "again", qwen2_model), eval_dataset=held_out(tmp_path))
    again.train()
    assert eval_rows(again.cfg.output_dir) == rows
    history = [h for h in evaluated.state.log_history if "eval_reward" in h]
    assert [h["step"] for h in history] == [0, 2, 4]  # its own rows, as the HF Trainer keeps them


def split_dataset(tmp_path) -> str:
    """A dataset directory with `train` and `test` splits, as `dataset_test_split` reads it from the command line."""
    path = tmp_path / "splits"
    if not path.exists():
        train = datasets.load_dataset("json", data_files=str(prompt_file(tmp_path / "train")), split="train")
        datasets.DatasetDict({"train": train, "test": held_out(tmp_path)}).save_to_disk(str(path))
    return str(path)


def test_a_resumed_run_neither_repeats_nor_skips_an_evaluation(tmp_path, qwen2_model, monkeypatch):
    common = dict(beta=0.05, max_steps=6, save_steps=2, **EVAL)
    straight = RLOOTrainer(engine_config(tmp_path / "straight", qwen2_model, dataset_name=split_dataset(tmp_path),
                                         **common))
    straight.train()
    run = tmp_path / "crashed"
    train_until_crash(run, qwen2_model, monkeypatch, 3, dataset_name=split_dataset(tmp_path), **common)
    resumed = RLOOTrainer(engine_config(run, qwen2_model, dataset_name=split_dataset(tmp_path),
                                        resume_from_checkpoint="latest", **common))
    resumed.train()
    assert [r["step"] for r in eval_rows(resumed.cfg.output_dir)] == [0, 2, 4, 6]
    assert eval_rows(resumed.cfg.output_dir) == eval_rows(straight.cfg.output_dir)


def test_each_of_a_dict_of_eval_datasets_has_its_prefix_and_epoch_strategy_evaluates_per_pass(tmp_path, qwen2_model):
    # 8 training prompts, 2 a step: a pass every 4 steps.
    trainer = RLOOTrainer(
        model=str(qwen2_model), reward_funcs=target_token_fraction,
        args=RLOOConfig(output_dir=str(tmp_path / "out"), num_generations=4, per_device_train_batch_size=8,
                        max_completion_length=6, max_steps=8, logging_steps=4, save_steps=0, disable_tqdm=True, beta=0.0,
                        eval_strategy="epoch", per_device_eval_batch_size=4),
        train_dataset=datasets.load_dataset("json", data_files=str(prompt_file(tmp_path, n=8)), split="train"),
        eval_dataset={"short": held_out(tmp_path, n=3), "long": held_out(tmp_path / "b", n=5)},
    )
    trainer.train()
    rows = [r for r in read_metrics(trainer.cfg.output_dir) if any(k.startswith("eval_") for k in r)]
    assert [r["step"] for r in rows] == [4, 8]
    assert {"eval_short_reward", "eval_long_reward", "eval_short_completions/mean_length"} <= set(rows[0])
    assert "eval_reward" not in rows[0] and "eval_short_kl" not in rows[0]  # beta 0: no reference, no KL


def test_the_command_line_evaluates_dataset_test_split(tmp_path, qwen2_model):
    out = tmp_path / "out"
    base = [sys.executable, "-m", "rloo_engine", "train", "--model_name_or_path", str(qwen2_model),
            "--reward_funcs", "tests.engine.helpers:target_token_fraction", "--output_dir", str(out),
            "--num_generations", "4", "--per_device_train_batch_size", "8", "--max_completion_length", "4",
            "--max_steps", "2", "--disable_tqdm", "--eval_strategy", "steps", "--eval_steps", "1",
            "--per_device_eval_batch_size", "8"]
    env = {**os.environ, "PYTHONPATH": repo_pythonpath()}
    proc = subprocess.run(base + ["--dataset_name", split_dataset(tmp_path)], capture_output=True, text=True,
                          timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [r["step"] for r in read_metrics(out) if "eval_reward" in r] == [1, 2]
    one_file = subprocess.run(base + ["--dataset_name", str(prompt_file(tmp_path)), "--output_dir", str(tmp_path / "b")],
                              capture_output=True, text=True, timeout=300, env=env)
    assert one_file.returncode == 2
    assert "is one file, which has no 'test' split of held-out prompts" in one_file.stderr


def test_eval_metrics_reach_mlflow(tmp_path, qwen2_model, monkeypatch):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    mlflow.set_tracking_uri(uri)
    exp = mlflow.create_experiment("eval-test", artifact_location=str(tmp_path / "artifacts"))
    run = mlflow.MlflowClient(uri).create_run(exp)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_RUN_ID", run.info.run_id)
    RLOOTrainer(tiny_config(tmp_path, qwen2_model), eval_dataset=held_out(tmp_path)).train()
    client = mlflow.MlflowClient(uri)
    assert [m.step for m in client.get_metric_history(run.info.run_id, "eval_reward")] == [0, 2, 4]
    assert [m.step for m in client.get_metric_history(run.info.run_id, "eval_kl")] == [0, 2, 4]


@pytest.mark.parametrize(("overrides", "message"), [
    ({"per_device_eval_batch_size": 3}, "per_device_eval_batch_size: 3 is not a multiple of num_generations_eval=2"),
    ({"async_generation": True, "use_vllm": True, "vllm_mode": "server"},
     "eval_strategy: 'steps' with async_generation: true"),
    ({"eval_steps": 2.5}, "eval_steps: 2.5; expected a whole number of steps"),
])
def test_eval_options_that_cannot_work_are_refused(tmp_path, qwen2_model, overrides, message):
    with pytest.raises(ConfigError, match=message):
        tiny_config(tmp_path, qwen2_model, **overrides)


def test_eval_strategy_without_an_eval_dataset_is_named(tmp_path, qwen2_model):
    with pytest.raises(ConfigError, match="eval_strategy: 'steps', but dataset_name .* is one file"):
        RLOOTrainer(tiny_config(tmp_path, qwen2_model))


def test_the_eval_cost_bench_runs_a_cell(tmp_path):
    """bench/eval_cost.py, whose grid bench/README.md quotes, on its smallest cell."""
    from tests.engine.helpers import REPO

    proc = subprocess.run([sys.executable, "bench/eval_cost.py", "--hidden", "32", "--vocab", "512",
                           "--prompt-length", "8", "--steps", "2", "--eval-prompts", "4"], cwd=REPO, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHONPATH": repo_pythonpath()})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "worst cell: hidden 32 vocab 512 prompt 8: an eval completion costs" in proc.stdout
