"""EvalConfig validation at the boundary, and the `rloo-engine evaluate` command."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from rloo_engine import cli as rloo_cli
from rloo_engine.evaluation import ConfigError, EvalConfig, load_eval_config, run_evaluation
from rloo_engine.evaluation.cli import main as evaluate_main
from rloo_engine.evaluation.config import build_eval_config
from tests.evaluation.eval_helpers import API_KEY_ENV, config_values

REPO = Path(__file__).resolve().parents[2]
PYTHON_JUDGE = {"backend": "python", "function": "tests.evaluation.eval_helpers:prefer_longer"}


def _error(values: dict) -> str:
    with pytest.raises(ConfigError) as err:
        build_eval_config(values)
    return str(err.value)


def test_unknown_options_are_rejected_naming_the_field():
    message = _error({"prompts": "p.jsonl", "judge": {**PYTHON_JUDGE, "temprature": 0.5}})
    assert "judge.temprature" in message and "unknown option" in message
    assert "bootstrap_resample" in _error({"prompts": "p.jsonl", "judge": PYTHON_JUDGE, "bootstrap_resample": 5})


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ({"judge": {"backend": "openai"}}, "model: not set"),
        ({"judge": {"backend": "python", "function": "no_colon"}}, "function"),
        ({"judge": {"backend": "gpt"}}, "judge.backend"),
        ({"judge": {"backend": "openai", "model": "m", "base_url": "localhost:8000"}}, "base_url"),
        ({"judge": PYTHON_JUDGE, "bootstrap_resamples": 100}, "bootstrap_resamples"),
        (
            {"judge": PYTHON_JUDGE, "policy_model_path": "a", "policy_completions": "b"},
            "policy_model_path and policy_completions",
        ),
        ({"judge": {"backend": "openai", "model": "gpt-4o"}, "budget_usd": 5.0}, "budget_usd: 5.0 needs the price"),
        ({"judge": PYTHON_JUDGE, "pairings": ["policy_vs_reference", "policy_vs_reference"]}, "pairings"),
        ({}, "judge: required option is missing"),
    ],
)
def test_invalid_values_fail_with_the_field_named(values, expected):
    assert expected in _error({"prompts": "p.jsonl", **values})


def test_the_example_config_is_valid():
    cfg = load_eval_config(REPO / "configs" / "eval_example.yaml")
    assert cfg.judge.backend == "openai" and cfg.judge.api_key_env == "OPENAI_API_KEY"
    assert cfg.budget_usd and cfg.judge.model in cfg.prices


def test_pairings_need_their_sides(tmp_path, eval_files):
    base = {
        "prompts": str(eval_files.prompts),
        "judge": PYTHON_JUDGE,
        "output_dir": str(tmp_path / "o"),
        "progress": False,
    }
    with pytest.raises(ConfigError, match="no pairing has both of its sides"):
        run_evaluation(EvalConfig.model_validate({**base, "policy_completions": str(eval_files.policy)}))
    with pytest.raises(ConfigError, match="policy_vs_sft needs sft completions"):
        run_evaluation(
            EvalConfig.model_validate(
                {
                    **base,
                    "policy_completions": str(eval_files.policy),
                    "reference_column": "reference",
                    "pairings": ["policy_vs_sft"],
                }
            )
        )
    report = run_evaluation(
        EvalConfig.model_validate(
            {
                **base,
                "policy_completions": str(eval_files.policy),
                "reference_column": "reference",
            }
        )
    )
    assert list(report.pairings) == ["policy_vs_reference"] and report.paired_difference is None


def test_a_missing_api_key_is_a_config_error_before_any_work(tmp_path, eval_files, monkeypatch):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    cfg = EvalConfig.model_validate(config_values(eval_files, "http://127.0.0.1:9/v1", tmp_path / "out"))
    with pytest.raises(ConfigError, match=f"judge.api_key_env: environment variable {API_KEY_ENV} is not set"):
        run_evaluation(cfg)


def test_cli_runs_an_evaluation_and_prints_a_summary(tmp_path, eval_files, capsys):
    config = tmp_path / "eval.yaml"
    values = config_values(eval_files, "unused", tmp_path / "from_config")
    values["judge"] = PYTHON_JUDGE
    config.write_text(yaml.safe_dump(values))
    out = tmp_path / "from_flag"
    # through the top-level `rloo-engine evaluate` dispatch
    assert rloo_cli.main(["evaluate", "--config", str(config), "--output_dir", str(out), "--no_progress"]) == 0
    printed = capsys.readouterr().out
    assert "policy_vs_reference" in printed and "win" in printed
    results = json.loads((out / "results.json").read_text())
    assert set(results["pairings"]) == {"policy_vs_reference", "sft_vs_reference", "policy_vs_sft"}
    assert not (tmp_path / "from_config").exists()  # --output_dir overrides the config


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ("judge: [unclosed", "not valid YAML"),
        ("prompts: PROMPTS\njudge: {backend: python, function: nope}\n", "judge.function: 'nope'"),
        ("prompts: PROMPTS\njudge: {backend: python, function: 'no_such_module_xyz:f'}\n", "module 'no_such_module_xyz' not found"),
        (
            "prompts: PROMPTS\nreference_column: summary\n"
            "judge: {backend: python, function: 'tests.evaluation.eval_helpers:prefer_longer'}\n",
            "reference_column",
        ),
    ],
)
def test_cli_returns_2_with_a_clear_message_on_config_errors(tmp_path, capsys, content, expected):
    config = tmp_path / "eval.yaml"
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "x", "reference": "y"}\n')
    config.write_text(content.replace("PROMPTS", str(prompts)))
    code = evaluate_main(["--config", str(config), "--output_dir", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and expected in err


def test_cli_returns_2_for_a_missing_config_file(tmp_path, capsys):
    assert evaluate_main(["--config", str(tmp_path / "missing.yaml")]) == 2
    assert "does not exist" in capsys.readouterr().err
