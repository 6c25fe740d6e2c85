"""One engine run's reliability: output_dir lock, checkpoint validation, history once, disk, rewards, early checks."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import mlflow
import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM

from rloo_engine.config_base import ConfigError
from rloo_engine.reward_sources import RewardError
from rloo_engine.run import checkpoint as ckpt
from rloo_engine.run.fault_injection import CRASH_ENV
from rloo_engine.run.lock import OutputDirLocked, acquire_run_lock
from rloo_engine.trainer import RLOOTrainer
from tests.engine.helpers import read_metrics, repo_pythonpath, tiny_config, train_until_crash
from tests.engine.test_cli_and_processes import REPO, run


def engine_env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": repo_pythonpath(), "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1",
           "MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING": "false"}
    env.pop("MLFLOW_TRACKING_URI", None)
    env.pop("MLFLOW_RUN_ID", None)
    return {**env, **extra}


def write_config(cfg, path: Path) -> Path:
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    return path


# ---------------------------------------------------------------- 1. one run per output_dir


HOLD_LOCK = (
    "import sys, time\n"
    "from rloo_engine.run.lock import acquire_run_lock\n"
    "acquire_run_lock(sys.argv[1])\n"
    "print('locked', flush=True)\n"
    "time.sleep(120)\n"
)


def test_lock_names_its_holder_and_a_killed_holder_does_not_block(tmp_path):
    out, other = tmp_path / "out", tmp_path / "other"
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(out)], env=engine_env(), stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(OutputDirLocked) as err:
            acquire_run_lock(out)
        message = str(err.value)
        assert f"output_dir: {out} is in use by another run" in message
        assert f"pid {holder.pid}" in message and socket.gethostname() in message
        acquire_run_lock(other).release()  # another directory is independent
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert (out / ".rloo-engine.lock").read_text()  # the dead holder's lock file is still there ...
    lock = acquire_run_lock(out)  # ... and does not block: the kernel released its flock
    assert f'"pid": {os.getpid()}' in (out / ".rloo-engine.lock").read_text()
    lock.release()


def test_second_run_into_one_output_dir_is_refused_and_the_first_finishes(tmp_path, qwen2_model):
    cfg = tiny_config(tmp_path, qwen2_model, max_steps=30, save_steps=10)
    cfg_file = write_config(cfg, tmp_path / "cfg.yaml")
    cmd = [sys.executable, "-m", "rloo_engine", "train", "--config", str(cfg_file)]
    first = subprocess.Popen(cmd, cwd=REPO, env=engine_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
    metrics = Path(cfg.output_dir) / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while not metrics.exists() and time.monotonic() < deadline and first.poll() is None:
        time.sleep(0.2)
    assert metrics.exists(), first.communicate()[1][-3000:]
    second = run(cmd)
    still_running = first.poll() is None
    out, err = first.communicate(timeout=300)
    assert second.returncode == 2, second.stderr[-3000:]
    assert f"output_dir: {cfg.output_dir} is in use by another run (host {socket.gethostname()}, pid {first.pid}" \
        in second.stderr
    # Refused at once, not after waiting for the lock or loading anything: the first run was still training.
    assert still_running and "Loading weights" not in second.stderr
    assert first.returncode == 0, err[-3000:]
    assert [r["step"] for r in read_metrics(cfg.output_dir)] == list(range(1, 31))


# ---------------------------------------------------------------- 2 and 5. checkpoints are validated before loading


@pytest.fixture(scope="module")
def four_step_run(tmp_path_factory, qwen2_model):
    """A 4-step run with checkpoint-2 and checkpoint-4, and the straight 6-step run's final weights to compare with."""
    root = tmp_path_factory.mktemp("ckpt_src")
    common = dict(max_steps=6, save_steps=2, log_completions=True)
    straight = tiny_config(root / "straight", qwen2_model, **common)
    RLOOTrainer(straight).train()
    os.environ[CRASH_ENV] = "4"
    try:
        with pytest.raises(SystemExit):
            RLOOTrainer(tiny_config(root / "crashed", qwen2_model, **common)).train()
    finally:
        del os.environ[CRASH_ENV]
    return root, common, Path(straight.output_dir) / "final"


def copy_run(four_step_run, tmp_path: Path) -> Path:
    root, _, _ = four_step_run
    shutil.copytree(root / "crashed", tmp_path, dirs_exist_ok=True)
    return tmp_path / "out"


def truncate(path: Path, keep: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


CORRUPTIONS = {
    "empty random_states_0.pkl": (lambda c: (c / "accelerate/random_states_0.pkl").write_bytes(b""),
                                  "accelerate/random_states_0.pkl"),
    "truncated model.safetensors": (lambda c: truncate(c / "model.safetensors"), "model.safetensors"),
    "missing optimizer.bin": (lambda c: (c / "accelerate/optimizer.bin").unlink(), "accelerate/optimizer.bin"),
    "truncated optimizer.bin": (lambda c: truncate(c / "accelerate/optimizer.bin", 0.9), "accelerate/optimizer.bin"),
    "empty trainer_state.json": (lambda c: (c / "trainer_state.json").write_text(""), "trainer_state.json"),
    "missing trainer_state.json": (lambda c: (c / "trainer_state.json").unlink(), "trainer_state.json"),
    "truncated rank0.pt": (lambda c: truncate(c / "rank0.pt"), "rank0.pt"),
}


@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
def test_corrupt_latest_checkpoint_falls_back_to_the_newest_complete_one(corruption, four_step_run, tmp_path,
                                                                         qwen2_model, capsys):
    _, common, straight_final = four_step_run
    out = copy_run(four_step_run, tmp_path)
    damage, bad_file = CORRUPTIONS[corruption]
    damage(out / "checkpoint-4")
    cfg = tiny_config(tmp_path, qwen2_model, **common, resume_from_checkpoint="latest")
    result = RLOOTrainer(cfg).train()
    stderr = capsys.readouterr().err
    assert f"skipping {out / 'checkpoint-4'}: {bad_file}" in stderr
    assert f"resumed from {out / 'checkpoint-2'} at step 2" in stderr
    assert result.global_step == 6
    # The fallback is still exact: the same weights as a run that was never interrupted.
    a, b = (AutoModelForCausalLM.from_pretrained(p) for p in (straight_final, out / "final"))
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        torch.testing.assert_close(pa, pb, msg=f"parameter {name} differs")


@pytest.mark.parametrize("corruption", ["empty random_states_0.pkl", "truncated model.safetensors",
                                        "empty trainer_state.json"])
def test_corrupt_explicit_checkpoint_is_a_config_error_naming_path_and_file(corruption, four_step_run, tmp_path,
                                                                            qwen2_model):
    _, common, _ = four_step_run
    out = copy_run(four_step_run, tmp_path)
    damage, bad_file = CORRUPTIONS[corruption]
    damage(out / "checkpoint-4")
    cfg = tiny_config(tmp_path, qwen2_model, **common, resume_from_checkpoint=str(out / "checkpoint-4"))
    with pytest.raises(ConfigError) as err:
        RLOOTrainer(cfg)
    assert f"resume_from_checkpoint: {out / 'checkpoint-4'} cannot be resumed: {bad_file}" in str(err.value)


def test_corrupt_explicit_checkpoint_exits_2_on_the_command_line(four_step_run, tmp_path, qwen2_model):
    _, common, _ = four_step_run
    out = copy_run(four_step_run, tmp_path)
    (out / "checkpoint-4/accelerate/random_states_0.pkl").write_bytes(b"")
    cfg = tiny_config(tmp_path, qwen2_model, **common, resume_from_checkpoint=str(out / "checkpoint-4"))
    proc = run([sys.executable, "-m", "rloo_engine", "train", "--config", str(write_config(cfg, tmp_path / "c.yaml"))])
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "random_states_0.pkl" in proc.stderr and "Traceback" not in proc.stderr


def test_torn_last_line_of_metrics_is_repaired(four_step_run, tmp_path, qwen2_model):
    _, common, _ = four_step_run
    out = copy_run(four_step_run, tmp_path)
    with (out / "metrics.jsonl").open("a") as fh:
        fh.write('{"step": 5, "rew')  # killed mid-write
    cfg = tiny_config(tmp_path, qwen2_model, **common, resume_from_checkpoint="latest")
    RLOOTrainer(cfg).train()
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3, 4, 5, 6]


# ---------------------------------------------------------------- 3. every sink holds each step once


def completion_steps(out: Path) -> list[int]:
    rows = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines() if line]
    return sorted({r["step"] for r in rows}), len(rows)


def test_fresh_start_after_a_crash_before_the_first_checkpoint_writes_each_step_once(tmp_path, qwen2_model,
                                                                                      monkeypatch):
    common = dict(max_steps=4, save_steps=0, log_completions=True)
    train_until_crash(tmp_path, qwen2_model, monkeypatch, 2, **common)  # no checkpoint exists when it dies
    cfg = tiny_config(tmp_path, qwen2_model, **common, resume_from_checkpoint="latest")
    RLOOTrainer(cfg).train()
    out = Path(cfg.output_dir)
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3, 4]
    assert completion_steps(out) == ([1, 2, 3, 4], 4 * 8)


def standalone_mlflow(tmp_path, monkeypatch, experiment: str) -> str:
    """A SQLite MLflow store with `experiment`, named in the environment as a standalone engine run sees it
    (no parent run); returns its URI."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    mlflow.MlflowClient(uri).create_experiment(experiment, artifact_location=str(tmp_path / "artifacts"))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", experiment)
    monkeypatch.setenv("MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING", "false")
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    return uri


def test_standalone_resume_continues_one_mlflow_run_with_each_step_once(tmp_path, qwen2_model, monkeypatch):
    uri = standalone_mlflow(tmp_path, monkeypatch, "standalone")
    common = dict(max_steps=5, save_steps=2, log_completions=True)
    train_until_crash(tmp_path, qwen2_model, monkeypatch, 3, **common)  # checkpoint-2 is the newest
    client = mlflow.MlflowClient(uri)
    exp = client.get_experiment_by_name("standalone").experiment_id
    [crashed] = client.search_runs([exp])
    assert crashed.info.status == "FAILED"  # the engine ends the run it created when it dies of an error

    cfg = tiny_config(tmp_path, qwen2_model, **common, resume_from_checkpoint="latest")
    RLOOTrainer(cfg).train()
    [resumed] = client.search_runs([exp])  # the same run, continued
    assert resumed.info.run_id == crashed.info.run_id and resumed.info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(resumed.info.run_id, "reward")] == [1, 2, 3, 4, 5]
    out = Path(cfg.output_dir)
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3, 4, 5]
    assert completion_steps(out) == ([1, 2, 3, 4, 5], 5 * 8)


def test_a_fresh_run_marks_a_dead_runs_mlflow_run_failed(tmp_path, qwen2_model, monkeypatch):
    """A run killed outright leaves its MLflow run RUNNING; the next run in that directory ends it."""
    uri = standalone_mlflow(tmp_path, monkeypatch, "dead")
    cfg = tiny_config(tmp_path, qwen2_model, max_steps=2)
    cfg_file = write_config(cfg, tmp_path / "cfg.yaml")
    env = engine_env(MLFLOW_TRACKING_URI=uri, MLFLOW_EXPERIMENT_NAME="dead", RLOO_ENGINE_KILL_AT="1:logged")
    proc = subprocess.run([sys.executable, "-m", "rloo_engine", "train", "--config", str(cfg_file)], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    client = mlflow.MlflowClient(uri)
    exp = client.get_experiment_by_name("dead").experiment_id
    [dead] = client.search_runs([exp])
    assert dead.info.status == "RUNNING"
    RLOOTrainer(cfg).train()  # a fresh run (no resume) into the same directory
    dead = client.get_run(dead.info.run_id)
    assert dead.info.status == "FAILED"
    assert "died" in dead.data.tags["rloo.end_reason"]
    assert len(client.search_runs([exp])) == 2


# ---------------------------------------------------------------- 6. full disk


def test_save_refused_when_free_space_is_below_the_last_checkpoint(tmp_path, qwen2_model, monkeypatch):
    real = shutil.disk_usage

    def nearly_full(path):
        usage = real(path)
        return usage._replace(free=50_000)  # smaller than one tiny checkpoint (~400 kB)

    trainer = RLOOTrainer(tiny_config(tmp_path, qwen2_model, max_steps=6, save_steps=2))
    monkeypatch.setattr(ckpt.shutil, "disk_usage", nearly_full)
    with pytest.raises(ckpt.CheckpointWriteError) as err:
        trainer.train()
    out = Path(trainer.cfg.output_dir)
    message = str(err.value)
    assert f"checkpoint-4: {out} has 50000 bytes free" in message and "the last checkpoint took" in message
    assert (out / "checkpoint-2").is_dir()
    assert not list(out.glob(".tmp-*"))


def test_failed_checkpoint_write_removes_the_partial_dir_and_names_the_space(tmp_path, qwen2_model, monkeypatch):
    trainer = RLOOTrainer(tiny_config(tmp_path, qwen2_model, max_steps=4, save_steps=2))
    real_save = torch.save

    def disk_full(obj, f, *a, **k):
        if str(f).endswith("rank0.pt"):
            raise OSError(28, "No space left on device")
        return real_save(obj, f, *a, **k)

    monkeypatch.setattr(ckpt.torch, "save", disk_full)
    with pytest.raises(ckpt.CheckpointWriteError) as err:
        trainer.train()
    out = Path(trainer.cfg.output_dir)
    assert f"writing {out / '.tmp-checkpoint-2'} failed (OSError: [Errno 28] No space left on device)" in str(err.value)
    assert "bytes free on" in str(err.value)
    assert not list(out.glob(".tmp-*")) and not (out / "checkpoint-2").exists()


# ---------------------------------------------------------------- 7. reward sources that never score


@pytest.mark.parametrize("funcs", [["tests.engine.helpers:never_scores"],
                                   ["tests.engine.helpers:target_token_fraction", "tests.engine.helpers:never_scores"]])
def test_a_reward_source_that_never_scores_warns_then_fails(funcs, tmp_path, qwen2_model, capsys):
    trainer = RLOOTrainer(tiny_config(tmp_path, qwen2_model, reward_funcs=funcs, max_steps=6))
    with pytest.raises(RewardError) as err:
        trainer.train()
    index = len(funcs) - 1
    assert f"reward_funcs[{index}] tests.engine.helpers:never_scores scored none of its completions for 2 " \
           "generation batches in a row" in str(err.value)
    assert "reward_source_max_empty_steps" in str(err.value)
    warnings = [ln for ln in capsys.readouterr().err.splitlines() if "scored none of" in ln]
    assert len(warnings) == 2 and trainer.global_step == 1


def test_empty_steps_limit_is_configurable(tmp_path, qwen2_model, capsys):
    cfg = tiny_config(tmp_path, qwen2_model, max_steps=3, reward_source_max_empty_steps=0,
                      reward_funcs=["tests.engine.helpers:target_token_fraction", "tests.engine.helpers:never_scores"])
    assert RLOOTrainer(cfg).train().global_step == 3  # 0 = warn only
    assert sum("scored none of" in ln for ln in capsys.readouterr().err.splitlines()) == 3


# ---------------------------------------------------------------- 9. checked before any model loads


@pytest.fixture
def unloadable_policy(tmp_path) -> Path:
    """A directory no model loads from: an error from it means the check came after loading."""
    path = tmp_path / "broken_policy"
    path.mkdir()
    (path / "config.json").write_text("{not json")
    (path / "tokenizer_config.json").write_text("{not json")  # present, so the tokenizer-files check passes
    return path


def test_bad_reward_function_import_is_found_before_models_load(tmp_path, unloadable_policy):
    cfg = tiny_config(tmp_path, unloadable_policy, reward_funcs=["tests.engine.helpers:no_such_function"])
    with pytest.raises(ConfigError, match="reward_funcs: tests.engine.helpers:no_such_function"):
        RLOOTrainer(cfg)


def test_output_dir_that_is_a_file_is_found_before_models_load(tmp_path, unloadable_policy):
    (tmp_path / "out").write_text("not a directory")
    cfg = tiny_config(tmp_path, unloadable_policy)
    with pytest.raises(ConfigError, match=f"output_dir: {tmp_path / 'out'} is a file; expected a directory"):
        RLOOTrainer(cfg)


def test_bad_resume_path_is_found_before_models_load(tmp_path, unloadable_policy):
    cfg = tiny_config(tmp_path, unloadable_policy, resume_from_checkpoint=str(tmp_path / "checkpoint-9"))
    with pytest.raises(ConfigError, match=f"resume_from_checkpoint: {tmp_path / 'checkpoint-9'} does not exist"):
        RLOOTrainer(cfg)


def test_reward_model_tokenizer_larger_than_its_vocab_is_found_before_models_load(tmp_path, unloadable_policy,
                                                                                 reward_model):
    from rloo_engine.testing import tiny_models

    rm = tmp_path / "rm"
    shutil.copytree(reward_model, rm)
    bigger = tiny_models.train_tokenizer(style="bpe", vocab_size=600)  # saved over the 320-row model's own
    bigger.save_pretrained(rm)
    cfg = tiny_config(tmp_path, unloadable_policy, reward_funcs=[], reward_model_name_or_path=str(rm))
    with pytest.raises(ConfigError, match=rf"reward_model_name_or_path: {rm} has a tokenizer of {len(bigger)} tokens "
                                          r"but an embedding of 320 rows"):
        RLOOTrainer(cfg)


def test_a_resume_into_the_launchers_mlflow_run_sends_each_step_once(tmp_path, qwen2_model, monkeypatch):
    """The pipeline hands the engine its run (MLFLOW_RUN_ID); a retry redoes steps after the checkpoint."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = mlflow.MlflowClient(uri)
    exp = client.create_experiment("handed-in", artifact_location=str(tmp_path / "artifacts"))
    run_id = client.create_run(exp).info.run_id
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_RUN_ID", run_id)
    monkeypatch.setenv("MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING", "false")
    common = dict(max_steps=5, save_steps=2, resume_from_checkpoint="latest")
    monkeypatch.setenv(CRASH_ENV, "3")  # steps 1-3 logged, checkpoint-2 the newest: step 3 is redone
    with pytest.raises(SystemExit):
        RLOOTrainer(tiny_config(tmp_path, qwen2_model, **common)).train()
    monkeypatch.delenv(CRASH_ENV)
    RLOOTrainer(tiny_config(tmp_path, qwen2_model, **common)).train()
    assert [m.step for m in client.get_metric_history(run_id, "reward")] == [1, 2, 3, 4, 5]
    assert client.get_run(run_id).info.status == "RUNNING"  # the launcher owns this run's status
