"""Inputs that are not what they should be (a corrupt cache file, a JSONL file that is not UTF-8, a lone
surrogate in a completion) fail with a message naming the file and line, or just work."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from rloo_engine.config_base import ConfigError
from rloo_engine.evaluation import EvalConfig, run_evaluation
from rloo_engine.evaluation.cache import JudgmentCache, cache_key
from rloo_engine.evaluation.cli import main as evaluate_main
from rloo_engine.evaluation.data import load_completions, load_prompts
from rloo_engine.evaluation.judges.base import Judgment, SlotPair
from tests.evaluation.eval_helpers import config_values

PYTHON_JUDGE = {"backend": "python", "function": "tests.evaluation.eval_helpers:prefer_longer"}
GARBAGE = b"this is not an SQLite database, whatever its name says\n" * 200


def _cli(tmp_path: Path, values: dict, capsys) -> tuple[int, str]:
    config = tmp_path / "eval.yaml"
    config.write_text(yaml.safe_dump(values))
    code = evaluate_main(["--config", str(config), "--no_progress"])
    return code, capsys.readouterr().err


# ---------------------------------------------------------------- a corrupt cache file
def test_a_corrupt_cache_file_is_named_with_how_to_recover_and_left_in_place(tmp_path):
    path = tmp_path / "judge_cache.sqlite"
    path.write_bytes(GARBAGE)
    with pytest.raises(ConfigError) as err:
        JudgmentCache(path)
    message = str(err.value)
    assert str(path) in message and "not a readable SQLite judgment cache" in message
    assert "move it aside" in message and "was not deleted" in message
    assert path.read_bytes() == GARBAGE  # never removed or rewritten automatically


def test_a_cache_damaged_after_its_first_page_is_named_too(tmp_path):
    path = tmp_path / "judge_cache.sqlite"
    identity = {"backend": "python", "function": "f"}
    with JudgmentCache(path) as cache:
        for i in range(400):  # enough rows for the table to span many pages
            cache.put(f"k{i}", identity, None, SlotPair("p" * 200, f"a{i}", "b"), Judgment("ok", "A", ["A"]))
    data = bytearray(path.read_bytes())
    page = 4096
    data[2 * page :] = b"\xff" * (len(data) - 2 * page)  # keep the header and schema page, wreck the rest
    path.write_bytes(bytes(data))
    with pytest.raises(ConfigError, match="not a readable SQLite judgment cache"):
        with JudgmentCache(path) as cache:
            cache.get_many([f"k{i}" for i in range(400)])


def test_the_cli_exits_2_on_a_corrupt_cache(tmp_path, eval_files, capsys):
    path = tmp_path / "cache.sqlite"
    path.write_bytes(GARBAGE)
    values = config_values(eval_files, "unused", tmp_path / "out", cache_path=str(path))
    values["judge"] = PYTHON_JUDGE
    code, err = _cli(tmp_path, values, capsys)
    assert code == 2 and err.startswith("error: cache_path: ") and str(path) in err


# ---------------------------------------------------------------- a JSONL file that is not UTF-8
def _latin1_jsonl(path: Path, bad_line: int = 3) -> Path:
    lines = [json.dumps({"prompt": f"post {i}", "reference": f"ref {i}"}).encode() for i in range(1, 5)]
    lines[bad_line - 1] = '{"prompt": "café au lait", "reference": "r"}'.encode("latin-1")  # é as one byte 0xE9
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def test_a_prompts_jsonl_that_is_not_utf8_is_a_config_error_naming_file_and_line(tmp_path):
    path = _latin1_jsonl(tmp_path / "prompts.jsonl")
    with pytest.raises(ConfigError, match=rf"{path}:3: not valid UTF-8 \(byte 0xe9 at column 16\)"):
        load_prompts(str(path), reference_column="reference")


def test_a_completions_jsonl_that_is_not_utf8_is_a_config_error_naming_file_and_line(tmp_path):
    path = tmp_path / "policy.jsonl"
    path.write_bytes(b'{"prompt": "a", "completion": "fine"}\n{"prompt": "b", "completion": "na\xefve"}\n')
    with pytest.raises(ConfigError, match=rf"{path}:2: not valid UTF-8"):
        load_completions(path)


def test_a_json_prompt_list_that_is_not_utf8_names_the_line_too(tmp_path):
    path = tmp_path / "prompts.json"
    path.write_bytes(b'[\n {"prompt": "a"},\n {"prompt": "caf\xe9"}\n]\n')
    with pytest.raises(ConfigError, match=rf"{path}:3: not valid UTF-8"):
        load_prompts(str(path))


def test_the_cli_exits_2_on_a_prompts_file_that_is_not_utf8(tmp_path, eval_files, capsys):
    path = _latin1_jsonl(tmp_path / "prompts.jsonl")
    values = config_values(eval_files, "unused", tmp_path / "out", prompts=str(path))
    values["judge"] = PYTHON_JUDGE
    code, err = _cli(tmp_path, values, capsys)
    assert code == 2 and f"{path}:3: not valid UTF-8" in err


# ---------------------------------------------------------------- a lone surrogate in a completion
def test_cache_keys_of_text_with_a_lone_surrogate_are_deterministic_and_distinct():
    identity = {"backend": "openai", "model": "m"}
    broken = SlotPair("p", "half an emoji \ud83d", "b")
    key = cache_key(identity, broken)
    assert key == cache_key(dict(identity), SlotPair("p", "half an emoji \ud83d", "b"))
    assert key != cache_key(identity, SlotPair("p", "half an emoji \ufffd", "b"))
    assert key != cache_key(identity, SlotPair("p", "half an emoji \ud83e", "b"))


def test_a_completion_with_a_lone_surrogate_is_judged_and_reported(tmp_path, eval_files, fake_server, api_key):
    # A JSON writer that cut a UTF-16 string mid-pair leaves "\ud83d" escaped in the file: valid JSON, not text.
    rows = [json.loads(line) for line in eval_files.policy.read_text().splitlines()]
    rows[0]["completion"] += " \ud83d"
    eval_files.policy.write_text("".join(json.dumps(r) + "\n" for r in rows))
    server = fake_server("sensible")
    values = config_values(eval_files, server.base_url, tmp_path / "out", pairings=["policy_vs_reference"])
    report = run_evaluation(EvalConfig.model_validate(values))
    assert report.pairings["policy_vs_reference"].n_valid == 10
    first = next(row for row in report.table() if row["prompt"] == rows[0]["prompt"])
    assert first["completion_a"].endswith(" \ufffd")  # what any UTF-8 decoder shows for it
    again = run_evaluation(EvalConfig.model_validate(values))  # and the cache finds it again
    assert again.usage.requests == 0
