"""The command line (YAML + TRL-style flags) and multi-process runs under `accelerate launch`."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rloo_engine import exit_codes
from rloo_engine.cli import parse_train_args
from rloo_engine.config_base import ConfigError
from rloo_engine.run.fault_injection import CRASH_ENV, CRASH_EXIT_CODE
from tests.engine.helpers import prompt_file, read_metrics, repo_pythonpath

REPO = Path(__file__).resolve().parents[2]


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": repo_pythonpath(), "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    env.pop("MLFLOW_TRACKING_URI", None)
    env.pop("MLFLOW_RUN_ID", None)
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600, **kw)


def test_trl_command_line_runs(tmp_path, qwen2_model, reward_model):
    """A `trl rloo` command line with `trl rloo` swapped for `rloo-engine train`."""
    data = prompt_file(tmp_path)
    out = tmp_path / "out"
    trl_args = [
        "--model_name_or_path", str(qwen2_model), "--reward_model_name_or_path", str(reward_model),
        "--dataset_name", str(data), "--output_dir", str(out), "--per_device_train_batch_size", "4",
        "--num_generations", "4", "--max_completion_length", "6", "--beta", "0.05", "--learning_rate", "3e-6",
        "--max_steps", "2", "--use_peft", "--lora_r", "4", "--lora_alpha", "8", "--lora_dropout", "0.0",
        "--lora_target_modules", "q_proj", "v_proj", "--logging_steps", "1", "--report_to", "none",
        "--gradient-accumulation-steps", "1", "--torch_dtype", "float32", "--seed", "1",
        "--dataloader_num_workers", "0", "--push_to_hub", "false",
    ]
    proc = run([sys.executable, "-m", "rloo_engine", "train", *trl_args, "--disable_tqdm"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "report_to" not in proc.stderr  # a real option now, not an ignored flag
    # TRL options with no effect are named once; TRL's defaults kept different here are said once, at start.
    assert "ignoring TRL options with no effect here (docs/configuration.md says why): dataloader_num_workers" \
        in proc.stderr
    assert proc.stderr.count("bf16: false here (TRL: true) because") == 1
    assert "gradient_checkpointing: false here (TRL: true)" in proc.stderr
    # The run ends by saying where its outputs went.
    assert f"final model   {out / 'final'} (the LoRA adapter, PEFT layout)" in proc.stdout
    assert f"metrics       {out / 'metrics.jsonl'}" in proc.stdout
    assert "MLflow run    none (report_to: none)" in proc.stdout  # report_to none: not even with MLFLOW_* set
    # log_completions is false: no completions.jsonl exists, and the report names none.
    assert "completions   none (log_completions: false)" in proc.stdout and not (out / "completions.jsonl").exists()
    # DeepSpeed (installed here) guesses its accelerator on import; its "Setting accelerator to CPU" line is not ours
    assert "Setting accelerator to CPU" not in proc.stderr + proc.stdout
    assert (out / "final" / "adapter_config.json").is_file()  # LoRA: the adapter, as TRL saves it
    assert [r["step"] for r in read_metrics(out)] == [1, 2]


def test_yaml_config_with_flag_overrides(tmp_path):
    cfg_file = tmp_path / "cfg.yaml"
    cfg_file.write_text(yaml.safe_dump({"model_name_or_path": "m", "dataset_name": "d.jsonl",
                                        "reward_funcs": ["a:b"], "learning_rate": 1e-5, "beta": 0.2}))
    cfg = parse_train_args(["--config", str(cfg_file), "--learning_rate", "3e-6", "--use_peft",
                            "--lora_target_modules", "q_proj", "v_proj", "--generation_kwargs", '{"top_k": 5}'])
    assert cfg.learning_rate == 3e-6 and cfg.beta == 0.2 and cfg.use_peft
    assert cfg.lora_target_modules == ["q_proj", "v_proj"] and cfg.generation_kwargs == {"top_k": 5}


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--num_generations", "1"], "num_generations: 1"),
        (["--per_device_train_batch_size", "6", "--num_generations", "4"], "not divisible by num_generations=4"),
        (["--epsilon", "0"], "epsilon: 0.0; expected > 0"),
        (["--steps_per_generation", "2", "--generation_batch_size", "8"], "both set"),
        (["--generation_batch_size", "6"], "generation_batch_size: 6 is not divisible by num_generations=4"),
        (["--reward_weights", "1", "2"], "reward_weights: [1.0, 2.0] has 2 entries; expected 1"),
        (["--learning_rate", "-1"], "learning_rate"),
        (["--lr_scheduler_type", "wobbly"], "lr_scheduler_type: 'wobbly'"),
    ],
)
def test_bad_values_are_named(flags, message):
    base = ["--model_name_or_path", "m", "--dataset_name", "d", "--reward_funcs", "a:b", "--num_generations", "4",
            "--per_device_train_batch_size", "8"]
    with pytest.raises(ConfigError) as err:
        parse_train_args(base + flags)
    assert message in str(err.value)


def test_unknown_yaml_key_and_missing_file_are_named(tmp_path):
    cfg_file = tmp_path / "cfg.yaml"
    cfg_file.write_text("model_name_or_path: m\ndataset_name: d\nreward_funcs: [a:b]\nlearning_rte: 1\n")
    with pytest.raises(ConfigError, match="learning_rte: unknown option"):
        parse_train_args(["--config", str(cfg_file)])
    with pytest.raises(ConfigError, match="does not exist"):
        parse_train_args(["--config", str(tmp_path / "nope.yaml")])


def test_cli_reports_errors_before_loading_models(tmp_path):
    proc = run([sys.executable, "-m", "rloo_engine", "train", "--model_name_or_path", str(tmp_path / "missing"),
                "--dataset_name", str(prompt_file(tmp_path)), "--reward_funcs", "rloo_engine.reward_functions:brevity"])
    assert proc.returncode == 2
    assert f"model_name_or_path: local path {tmp_path / 'missing'} does not exist" in proc.stderr
    proc = run([sys.executable, "-m", "rloo_engine", "train", "--model_name_or_path", "m", "--dataset_name",
                str(tmp_path / "nope.jsonl"), "--reward_funcs", "rloo_engine.reward_functions:brevity"])
    assert proc.returncode == 2 and "nope.jsonl" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow
def test_two_process_accelerate_run_keeps_ranks_identical(tmp_path, qwen2_model):
    out = tmp_path / "out"
    args = ["--model_name_or_path", str(qwen2_model), "--dataset_name", str(prompt_file(tmp_path)),
            "--reward_funcs", "tests.engine.helpers:target_token_fraction", "--output_dir", str(out),
            "--num_generations", "4", "--per_device_train_batch_size", "4", "--max_completion_length", "6",
            "--beta", "0.05", "--learning_rate", "1e-2", "--max_steps", "3", "--logging_steps", "1",
            "--save_steps", "2", "--disable_tqdm"]
    # accelerate's `--cpu` launcher forks several processes only through mpirun; `--multi_gpu` launches
    # through torchrun, and the engine forms a gloo group when there is no accelerator.
    proc = run([sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2", "--main_process_port", "0",
                "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                str(REPO / "tests/engine/scripts/train_and_digest.py"), *args])
    assert proc.returncode == 0, proc.stderr[-4000:]
    digests = [json.loads((out / f"digest-rank{r}.json").read_text()) for r in (0, 1)]
    assert digests[0]["digest"] == digests[1]["digest"]
    assert digests[0]["step"] == digests[1]["step"] == 3
    assert digests[0]["prompts_seen"]["position"] == 6  # each step, each rank took its own prompt
    # the checkpoint holds each rank's own state, and only rank 0 wrote metrics
    assert {p.name for p in (out / "checkpoint-2").glob("rank*.pt")} == {"rank0.pt", "rank1.pt"}
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3]


@pytest.mark.slow
def test_accelerate_launch_module_entry_point(tmp_path, qwen2_model):
    """`accelerate launch -m rloo_engine train` as the pipeline's launcher runs it."""
    out = tmp_path / "out"
    proc = run([sys.executable, "-m", "accelerate.commands.launch", "--cpu", "--num_processes", "1",
                "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "-m", "rloo_engine",
                "train", "--model_name_or_path", str(qwen2_model), "--dataset_name", str(prompt_file(tmp_path)),
                "--reward_funcs", "rloo_engine.reward_functions:brevity", "--output_dir", str(out),
                "--num_generations", "2", "--per_device_train_batch_size", "4", "--max_completion_length", "4",
                "--max_steps", "1", "--disable_tqdm"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (out / "final").is_dir()


@pytest.mark.slow
def test_rloo_engine_train_trains_then_resumes_from_the_command_line(tmp_path, qwen2_model):
    """The command a user runs, as a process: it dies after step 2 (checkpoint-2 written), then resumes to step 3."""
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "rloo_engine", "train", "--model_name_or_path", str(qwen2_model),
           "--dataset_name", str(prompt_file(tmp_path)), "--reward_funcs", "rloo_engine.reward_functions:brevity",
           "--output_dir", str(out), "--num_generations", "2", "--per_device_train_batch_size", "4",
           "--max_completion_length", "4", "--beta", "0.05", "--logging_steps", "1", "--save_steps", "1",
           "--max_steps", "3", "--disable_tqdm"]
    first = subprocess.run(cmd, env={**os.environ, CRASH_ENV: "2"}, capture_output=True, text=True, timeout=300)
    assert first.returncode == CRASH_EXIT_CODE, first.stderr[-3000:]
    assert (out / "checkpoint-2").is_dir() and not (out / "final").exists()
    second = run(cmd + ["--resume_from_checkpoint", "latest"])
    assert second.returncode == 0, second.stderr[-3000:]
    assert f"resumed from {out / 'checkpoint-2'} at step 2" in second.stderr
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3]
    assert (out / "final").is_dir()


def _train_command(tmp_path, model, *extra):
    return ["--model_name_or_path", str(model), "--dataset_name", str(prompt_file(tmp_path)),
            "--output_dir", str(tmp_path / "out"), "--num_generations", "2", "--per_device_train_batch_size", "4",
            "--max_completion_length", "4", "--logging_steps", "1", "--disable_tqdm", *extra]


@pytest.mark.slow
def test_a_raising_reward_function_ends_in_one_error_line_and_exit_code_4(tmp_path, qwen2_model):
    proc = run([sys.executable, "-m", "rloo_engine", "train",
                *_train_command(tmp_path, qwen2_model, "--reward_funcs", "tests.engine.helpers:failing_reward",
                                "--max_steps", "2")])
    assert proc.returncode == exit_codes.REWARD_ERROR, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "failing_reward raised ConnectionError: reward service at" in errors[0], errors


@pytest.mark.slow
def test_a_full_disk_ends_in_one_error_line_and_exit_code_5(tmp_path, qwen2_model):
    # The free-space check before checkpoint-2 measures checkpoint-1; the disk then reports 1 KiB free.
    script = (
        "import shutil, sys\n"
        "from collections import namedtuple\n"
        "usage = namedtuple('usage', 'total used free')\n"
        "shutil.disk_usage = lambda path: usage(2**40, 2**40 - 1024, 1024)\n"
        "from rloo_engine.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    proc = run([sys.executable, "-c", script, "train",
                *_train_command(tmp_path, qwen2_model, "--reward_funcs", "rloo_engine.reward_functions:brevity",
                                "--max_steps", "3", "--save_steps", "1")])
    assert proc.returncode == exit_codes.DISK_ERROR, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "checkpoint-2: " in errors[0] and "has 1024 bytes free" in errors[0], errors
    assert (tmp_path / "out" / "checkpoint-1").is_dir()  # what was done is kept


def test_latest_names_each_unusable_checkpoint_and_says_when_there_is_none_yet(tmp_path, capsys):
    from rloo_engine.run.checkpoint import resolve_resume

    assert resolve_resume("latest", tmp_path) is None
    assert f"rloo-engine: no checkpoint in {tmp_path} yet; starting from step 0" in capsys.readouterr().err
    (tmp_path / "checkpoint-2").mkdir()  # no trainer_state.json: unusable
    assert resolve_resume("latest", tmp_path) is None
    err = capsys.readouterr().err
    assert f"skipping {tmp_path / 'checkpoint-2'}" in err
    # Not "starting from step 0": with only unusable checkpoints the start check refuses, saying what to do
    # (tests/engine/test_bad_inputs_round3.py).
    assert "starting from step 0" not in err


def _train_in_each_rank(tmp_path: Path, model: Path, dirs: list[Path],
                        reward: str = "rloo_engine.reward_functions:brevity", launcher_exit: int = 0) -> list[dict]:
    """`rloo-engine train` on 2 processes, rank r writing into dirs[r % len(dirs)]; the outcome of each rank
    whose `main` returned (the launcher stops the other ranks when one exits non-zero)."""
    flags = ("--model_name_or_path", str(model), "--dataset_name", str(prompt_file(tmp_path)),
             "--reward_funcs", reward, "--num_generations", "2", "--per_device_train_batch_size", "2",
             "--max_completion_length", "4", "--max_steps", "1", "--disable_tqdm")
    proc = run([sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2", "--main_process_port", "0",
                "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                str(REPO / "tests/engine/scripts/train_in_each_rank.py"), os.pathsep.join(map(str, dirs)), *flags])
    assert proc.returncode == launcher_exit, proc.stderr[-4000:]
    outcomes = [dirs[r % len(dirs)] / f"outcome-rank{r}.json" for r in (0, 1)]
    return [json.loads(o.read_text()) for o in outcomes if o.exists()]


@pytest.mark.slow
def test_every_rank_refuses_an_output_dir_that_is_not_shared_and_ends_its_process_group(tmp_path, qwen2_model):
    """Rank 1 looks at another directory, as a node without the shared filesystem sees its local disk: both ranks
    exit 2 with the same error, naming rank 1's host and path, and neither hangs. Whether the run fails so or
    trains, `main` destroys the process group before it returns: left to interpreter teardown, gloo's threads
    abort the process now and then ("terminate called without an active exception", SIGABRT), a crash instead
    of the exit code."""
    shared, local = tmp_path / "shared", tmp_path / "node1-local"
    shared.mkdir(), local.mkdir()
    outcomes = _train_in_each_rank(tmp_path, qwen2_model, [shared, local])
    for outcome in outcomes:  # each rank names its own output_dir, the same path on real nodes
        (error,) = [line for line in outcome["stderr"].splitlines() if line.startswith("error: ")]
        assert f"rank 1 on {socket.gethostname()}: {local}/.rloo-engine-shared-check cannot be read" in error
        assert "rank 0 on" not in error and error.startswith("error: output_dir: ")
        assert outcome["code"] == exit_codes.CONFIG_ERROR and not outcome["group_outlived_main"]
    assert not (shared / ".rloo-engine-shared-check").exists()  # the token does not outlive the check
    assert not (shared / "checkpoint-1").exists() and not (shared / "final").exists()  # refused before training
    # a shared directory passes, the run trains, and the group ends with it on both ranks
    same = tmp_path / "same"
    outcomes = _train_in_each_rank(tmp_path, qwen2_model, [same])
    assert [(o["code"], o["group_outlived_main"], o["ddp_models_alive"]) for o in outcomes] == [(0, False, 0)] * 2
    assert (same / "final").is_dir() and not (same / ".rloo-engine-shared-check").exists()


@pytest.mark.slow
def test_a_rank_that_fails_alone_exits_with_its_code_its_group_ended(tmp_path, qwen2_model):
    """Rank 1's reward service is down while rank 0's is up: rank 1's `main` returns exit code 4 with one error
    line and its gloo group destroyed (no abort at exit to hide the code), and the launcher stops rank 0."""
    out = tmp_path / "out"
    outcomes = _train_in_each_rank(tmp_path, qwen2_model, [out], reward="tests.engine.helpers:failing_reward_on_rank_1",
                                   launcher_exit=1)
    (rank1,) = [o for o in outcomes if o["rank"] == 1]
    assert rank1["code"] == exit_codes.REWARD_ERROR and not rank1["group_outlived_main"]
    assert rank1["ddp_models_alive"] == 0  # the failed trainer's model (it holds the group) freed before exit
    (error,) = [line for line in rank1["stderr"].splitlines() if line.startswith("error: ")]
    assert "failing_reward_on_rank_1 raised ConnectionError: reward service at" in error
