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
    [("--num_generation", "--num_generations"), ("--per_device", "--per_device_train_batch_size")],
)
def test_an_abbreviated_flag_is_refused_with_the_full_name_suggested(capsys, flag, meant):
    err = usage_error(capsys, cli.parse_train_args, [*BASE, flag, "4"])
    assert err.count("\n") == 1, err  # one line, not the 60-line usage text
    assert f"unknown option {flag}; did you mean {meant}?" in err


def test_a_misspelt_flag_gets_the_closest_known_flag(capsys):
    err = usage_error(capsys, cli.parse_train_args, [*BASE, "--learning_rte", "1e-5"])
    assert "rloo-engine train: error: unknown option --learning_rte; did you mean --learning_rate?" in err
    assert "--help` lists the options" in err


def test_several_unknown_flags_each_get_their_suggestion(capsys):
    err = usage_error(capsys, cli.parse_train_args, [*BASE, "--num_generation", "4", "--bta", "0.1"])
    assert "--num_generations (for --num_generation)" in err and "--beta (for --bta)" in err


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
