"""Reliability round 3 (issue 44): the last bad inputs that ended in a traceback or a wrong message, each now one
`error:` line naming the input, before any model loads (or exit 5 for a full disk while writing `final/`)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from rloo_engine import exit_codes
from rloo_engine.config_base import ConfigError, load_yaml
from rloo_engine.run import checkpoint as ckpt
from rloo_engine.trainer import RLOOTrainer
from tests.engine.helpers import REPO, prompt_file, repo_pythonpath, tiny_config, train_until_crash


def engine(tmp_path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": repo_pythonpath()}
    env.pop("MLFLOW_TRACKING_URI", None)
    return subprocess.run([sys.executable, "-m", "rloo_engine", "train", *args], capture_output=True, text=True,
                          timeout=300, cwd=REPO, env=env)


def flags(tmp_path, model, **over) -> list[str]:
    values = {"model_name_or_path": str(model), "dataset_name": str(prompt_file(tmp_path)),
              "reward_funcs": "rloo_engine.reward_functions:brevity", "output_dir": str(tmp_path / "out"),
              "max_completion_length": "4", "num_generations": "2", "per_device_train_batch_size": "4",
              "max_steps": "1", **over}
    return [part for k, v in values.items() for part in (f"--{k}", v)]


def one_error_line(proc) -> str:
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr[-3000:]
    return errors[0]


def test_a_policy_directory_without_tokenizer_files_is_named_before_any_model_loads(tmp_path, qwen2_model):
    bare = tmp_path / "no-tokenizer"
    shutil.copytree(qwen2_model, bare)
    for f in bare.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template", "vocab", "merges")):
            f.unlink()
    proc = engine(tmp_path, *flags(tmp_path, bare))
    assert proc.returncode == exit_codes.CONFIG_ERROR
    assert f"model_name_or_path: {bare} has no tokenizer files" in one_error_line(proc)
    assert "Loading weights" not in proc.stderr  # refused before any model loads


def test_an_empty_dataset_file_is_named(tmp_path, qwen2_model):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    proc = engine(tmp_path, *flags(tmp_path, qwen2_model, dataset_name=str(empty)))
    assert proc.returncode == exit_codes.CONFIG_ERROR
    assert f"dataset_name: {empty} is an empty file; expected at least one row" in one_error_line(proc)


def test_a_binary_yaml_and_a_key_given_twice_are_named(tmp_path):
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"\xff\xfe\x00lr")
    with pytest.raises(ConfigError, match=rf"--config: {binary} is not UTF-8 text \(byte 0 is 0xff\)"):
        load_yaml(binary)
    twice = tmp_path / "twice.yaml"
    twice.write_text("learning_rate: 1e-5\nbeta: 0.1\nlearning_rate: 2e-5\n")
    with pytest.raises(ConfigError, match="key 'learning_rate' appears twice \\(lines 1 and 3\\); keep one"):
        load_yaml(twice)
    proc = engine(tmp_path, "--config", str(binary))
    assert proc.returncode == exit_codes.CONFIG_ERROR and "is not UTF-8 text" in one_error_line(proc)


def test_latest_with_no_usable_checkpoint_says_what_to_do_instead(tmp_path, qwen2_model, monkeypatch):
    train_until_crash(tmp_path, qwen2_model, monkeypatch, 3, max_steps=4, save_steps=1, save_total_limit=2)
    out = tmp_path / "out"
    for checkpoint in out.glob("checkpoint-*"):
        (checkpoint / ckpt.STATE_FILE).unlink()  # every checkpoint unusable
    with pytest.raises(ConfigError) as err:
        RLOOTrainer(tiny_config(tmp_path, qwen2_model, max_steps=4, save_steps=1, resume_from_checkpoint="latest"))
    message = str(err.value)
    assert f"resume_from_checkpoint: latest found no usable checkpoint in {out}" in message
    assert "--overwrite_output_dir true" in message and "--resume_from_checkpoint latest" not in message


def test_a_full_disk_while_writing_final_exits_5_keeps_the_checkpoint_and_leaves_no_partial_write(tmp_path,
                                                                                                 qwen2_model):
    # safetensors reports a full disk with its own error type, not OSError.
    script = (
        "import sys, safetensors.torch as st\n"
        "from safetensors import SafetensorError\n"
        "real = st.save_file\n"
        "def full(tensors, filename, *a, **k):\n"
        "    if '.tmp-final' in str(filename):\n"
        "        open(filename, 'wb').write(b'x' * 10)\n"
        "        raise SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, '\n"
        "                              'message: \"No space left on device\" })')\n"
        "    return real(tensors, filename, *a, **k)\n"
        "st.save_file = full\n"
        "import transformers.modeling_utils as mu\n"
        "mu.safe_save_file = full\n"
        "from rloo_engine.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    env = {**os.environ, "PYTHONPATH": repo_pythonpath()}
    env.pop("MLFLOW_TRACKING_URI", None)
    proc = subprocess.run([sys.executable, "-c", script, "train", *flags(tmp_path, qwen2_model, max_steps="3",
                                                                         save_steps="2")],
                          capture_output=True, text=True, timeout=300, cwd=REPO, env=env)
    out = tmp_path / "out"
    assert proc.returncode == exit_codes.DISK_ERROR, proc.stderr[-3000:]
    line = one_error_line(proc)
    assert f"final: writing {out / 'final'} failed (SafetensorError" in line and "No space left on device" in line
    assert f"the newest checkpoint, {out / 'checkpoint-2'}, is kept" in line
    assert not list(out.glob(".tmp-*")) and not (out / "final").exists()
    assert (out / "checkpoint-2" / ckpt.STATE_FILE).is_file()
    assert Path(out / "checkpoint-2").is_dir()


def test_a_malformed_data_file_names_the_parse_error_under_datasets_own(tmp_path):
    from rloo_engine.data import DataError, load_prompt_dataset

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a"}\n{bad json\n')
    with pytest.raises(DataError) as err:
        load_prompt_dataset(str(bad))
    message = str(err.value)
    assert message.startswith(f"dataset_name: {bad} could not be loaded: DatasetGenerationError")
    assert message.endswith(")") and " (" in message  # the parse error itself, not only "an error occurred"
