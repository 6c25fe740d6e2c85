"""What a newcomer meets at the command line: refused abbreviations, one-line errors with a suggestion,
missing model paths named before anything is loaded, a top-level help that lists the commands."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from rloo_engine import cli
from rloo_engine.config import build_config
from rloo_engine.config_base import ConfigError
from rloo_engine.evaluation.cli import parser as evaluate_parser
from tests.engine.helpers import prompt_file, repo_pythonpath

REPO = Path(__file__).resolve().parents[2]
BASE = ["--model_name_or_path", "org/name", "--dataset_name", "d.jsonl", "--reward_funcs", "a:b"]


def usage_error(capsys, parse, argv) -> str:
    with pytest.raises(SystemExit) as exc:
        parse(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize(
    ("flag", "meant"),
    [("--num_generation", "--num_generations"), ("--per_device", "--per_device_eval_batch_size or --per_device_train_batch_size")],
)
def test_an_abbreviated_flag_is_refused_with_the_full_name_suggested(capsys, flag, meant):
    err = usage_error(capsys, cli.parse_train_args, [*BASE, flag, "4"])
    assert err.count("\n") == 1, err  # one line, not the 60-line usage text
    assert f"unknown option {flag}; did you mean {meant}" in err


def test_a_misspelt_flag_gets_the_closest_known_flag(capsys):
    err = usage_error(capsys, cli.parse_train_args, [*BASE, "--learning_rte", "1e-5"])
    assert "rloo-engine train: error: unknown option --learning_rte; did you mean --learning_rate?" in err
    assert "--help` lists the options" in err


def test_several_unknown_flags_each_get_their_suggestion(capsys):
    err = usage_error(capsys, cli.parse_train_args, [*BASE, "--num_generation", "4", "--bta", "0.1"])
    assert "--num_generations or --num_generations_eval (for --num_generation)" in err and "--beta (for --bta)" in err


def test_every_command_refuses_abbreviations(capsys):
    from flows.command_line import run_from_command_line
    from flows.demo import main as demo_main

    assert "did you mean --config?" in usage_error(capsys, evaluate_parser().parse_args, ["--conf", "x.yaml"])
    from flows.rlhf_pipeline import rlhf_pipeline

    err = usage_error(capsys, lambda argv: run_from_command_line(rlhf_pipeline, argv, prog="flow"), ["--conf", "x"])
    assert "flow: error: unknown option --conf; did you mean --config?" in err
    assert "did you mean --smoke?" in usage_error(capsys, demo_main, ["--smok"])


def test_help_lists_each_command_with_a_line(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    for command in ("train", "evaluate", "tiny-assets"):
        assert any(line.split()[:1] == [command] and len(line.split()) > 3 for line in out.splitlines()), out


def test_an_unknown_command_suggests_the_closest(capsys):
    assert cli.main(["trian"]) == 2
    assert "unknown command 'trian'; did you mean train?" in capsys.readouterr().err


def test_a_hub_id_is_accepted_and_a_missing_local_path_is_named(tmp_path):
    for hub_id in ("gpt2", "Qwen/Qwen2.5-0.5B", "org/name-v1.5"):
        cfg = build_config({"model_name_or_path": hub_id, "dataset_name": "d.jsonl", "reward_funcs": ["a:b"]})
        assert cfg.model_name_or_path == hub_id
    for missing in (str(tmp_path / "sft"), "./out/final", "runs/1/train/final", "~/no-such-model-dir"):
        with pytest.raises(ConfigError, match=rf"model_name_or_path: local path {missing} does not exist"):
            build_config({"model_name_or_path": missing, "dataset_name": "d.jsonl", "reward_funcs": ["a:b"]})
    with pytest.raises(ConfigError, match=rf"reward_model_name_or_path: local path {tmp_path / 'rm'} does not exist"):
        build_config({"model_name_or_path": "org/name", "reward_model_name_or_path": str(tmp_path / "rm"),
                      "dataset_name": "d.jsonl"})
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"")
    with pytest.raises(ConfigError, match="is a file; expected a model directory"):
        build_config({"model_name_or_path": str(weights), "dataset_name": "d.jsonl", "reward_funcs": ["a:b"]})


def test_a_missing_model_path_fails_before_any_model_code_is_imported(tmp_path):
    """The decision is made from the string, so no hub client, torch or transformers runs first."""
    missing = tmp_path / "missing"
    check = (
        "import sys\n"
        "from rloo_engine.cli import main\n"
        f"code = main(['train', '--model_name_or_path', {str(missing)!r}, '--dataset_name', "
        f"{str(prompt_file(tmp_path))!r}, '--reward_funcs', 'rloo_engine.reward_functions:brevity'])\n"
        "loaded = sorted(m for m in ('torch', 'transformers', 'huggingface_hub') if m in sys.modules)\n"
        "print('loaded:', loaded)\n"
        "sys.exit(code)\n"
    )
    env = {**os.environ, "PYTHONPATH": repo_pythonpath()}
    proc = subprocess.run([sys.executable, "-c", check], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert f"error: rloo-engine train: model_name_or_path: local path {missing} does not exist" in proc.stderr
    assert "Repo id must be" not in proc.stderr and "Traceback" not in proc.stderr
    assert "loaded: []" in proc.stdout  # decided from the string: no hub client, torch or transformers ran


@pytest.mark.parametrize(
    "command",
    [
        ["-m", "rloo_engine", "--help"],
        ["-m", "rloo_engine", "train", "--help"],
        ["-m", "rloo_engine", "evaluate", "--help"],
        ["-m", "rloo_engine", "tiny-assets", "--help"],
        ["-m", "flows.rlhf_pipeline", "--help"],
        ["-m", "flows.evaluate_policy", "--help"],
        ["-m", "flows.demo", "--help"],
    ],
)
def test_every_command_prints_its_help_and_exits_0(command):
    proc = subprocess.run([sys.executable, *command], cwd=REPO, env={**os.environ, "PYTHONPATH": repo_pythonpath()},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "usage:" in proc.stdout and "Traceback" not in proc.stderr


def test_a_help_string_with_a_percent_sign_is_prose_not_a_format():
    from rloo_engine.argparsing import StrictArgumentParser

    p = StrictArgumentParser(prog="x")
    p.add_argument("--slow", help="~30% slower (20%), default %(default)s, literal %%", default=3)
    text = p.format_help()
    assert "~30% slower (20%), default 3, literal %" in " ".join(text.split())


def test_trl_dashed_and_no_spellings_are_accepted():
    """TRL's HfArgumentParser takes `--num-train-epochs` beside `--num_train_epochs`, and `--no_<flag>`."""
    cfg = cli.parse_train_args([*BASE, "--num-train-epochs", "2", "--no_shuffle_dataset", "--no-disable-tqdm"])
    assert cfg.num_train_epochs == 2.0 and cfg.shuffle_dataset is False and cfg.disable_tqdm is False


def test_a_refused_trl_option_names_the_reason_and_the_alternative():
    with pytest.raises(ConfigError) as err:
        cli.parse_train_args([*BASE, "--torch_compile", "--fsdp", "full_shard"])
    assert "torch_compile: True is not supported: models run eagerly here" in str(err.value)
    assert "fsdp: 'full_shard' is not supported: FSDP2 comes from the launch profile" in str(err.value)


def test_a_refused_trl_option_at_trls_default_asks_for_nothing_and_is_accepted(capsys):
    cli.parse_train_args([*BASE, "--push_to_hub", "false", "--eval_strategy", "no", "--logging_strategy", "steps"])
    assert capsys.readouterr().err == ""


def test_ignored_trl_options_are_named_on_one_line(capsys):
    cli.parse_train_args([*BASE, "--dataloader_num_workers", "4", "--eval_accumulation_steps", "2"])
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "ignoring TRL options with no effect here (docs/configuration.md says why): " \
        "dataloader_num_workers, eval_accumulation_steps" in err


def test_a_trl_yaml_file_loads_with_the_same_rules(tmp_path, capsys):
    path = tmp_path / "trl.yaml"
    path.write_text("model_name_or_path: org/name\ndataset_name: d.jsonl\nreward_funcs: [my_pkg.rewards.length]\n"
                    "report_to: none\ngradient_checkpointing: true\n"
                    "gradient_checkpointing_kwargs: {use_reentrant: false}\nwarmup_steps: 0.1\n"
                    "push_to_hub: false\ndataloader_num_workers: 2\nenv: {SOME_VAR: x}\n")
    command = cli.parse_train_command(["--config", str(path)])
    cfg = command.config
    assert cfg.report_to == [] and cfg.gradient_checkpointing_kwargs == {"use_reentrant": False}
    assert cfg.reward_funcs == ["my_pkg.rewards:length"] and cfg.warmup_ratio == 0.1 and cfg.warmup_steps == 0
    assert command.env == {"SOME_VAR": "x"}
    assert "dataloader_num_workers" in capsys.readouterr().err
    path.write_text("model_name_or_path: org/name\ndataset_name: d.jsonl\nreward_funcs: [a:b]\ntorch_compile: true\n")
    with pytest.raises(ConfigError, match=r"--config .*trl.yaml: torch_compile: True is not supported"):
        cli.parse_train_args(["--config", str(path)])


def test_trls_defaults_kept_different_are_said_once_unless_set():
    lines = cli.default_differences(cli.parse_train_command(BASE))
    assert [line.split(":")[1].strip() for line in lines] == ["bf16", "gradient_checkpointing"]
    assert lines[0].startswith("rloo-engine: bf16: false here (TRL: true) because ")
    assert cli.default_differences(cli.parse_train_command([*BASE, "--bf16", "false", "--gradient_checkpointing"])) \
        == []


def test_train_help_shows_each_default():
    text = " ".join(cli.train_parser().format_help().split())
    assert "(default: 3.0)" in text and "(default: 512)" in text  # num_train_epochs, max_completion_length: TRL's
    assert "(default: false; TRL: true, see the note printed at start)" in text  # bf16
