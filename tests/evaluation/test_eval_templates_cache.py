"""Judge templates, strict verdict parsing, the SQLite judgment cache and prompt ids."""

from __future__ import annotations

import json
import sqlite3
import textwrap
from contextlib import closing

import pytest

from rloo_engine.evaluation import ConfigError
from rloo_engine.evaluation.cache import JudgmentCache, cache_key
from rloo_engine.evaluation.data import load_completions, prompt_id
from rloo_engine.evaluation.judges.base import Judgment, SlotPair
from rloo_engine.evaluation.parsing import parse_label, parse_verdict
from rloo_engine.evaluation.templates import load_template


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Comparison: A is more concise.\nPreferred: A", "A"),
        ("Comparison: B covers the key point.\nPreferred: B\n\n", "B"),
        ('**Preferred:** "B".', "B"),
        ("preferred: a", "A"),
        ("Preferred: A\nI hope this helps!", "A"),  # prose after the verdict line is allowed (issue 10, item 7)
        ("Preferred: A\nPreferred: B", None),  # two different verdicts
        ("Preferred: A or B", None),
        ('Preferred: <"A" or "B">', None),
        ("Summary A is better.", None),
        ("A", None),
        ("", None),
        (None, None),
    ],
)
def test_verdict_parsing_is_strict_about_the_verdict_line(text, expected):
    assert parse_verdict(text) == expected


def test_python_judge_labels():
    assert [parse_label(v) for v in ("A", " b ", "TIE", "Comparison: x\nPreferred: B", "maybe", 1, None)] == [
        "A",
        "B",
        "tie",
        "B",
        None,
        None,
        None,
    ]


def test_builtin_templates_render_the_pair_in_its_slots():
    for name in ("tldr", "helpfulness"):
        template = load_template(name)
        messages = template.render("THE POST", "FIRST ANSWER", "SECOND ANSWER")
        user = messages[-1]["content"]
        assert user.index("THE POST") < user.index("FIRST ANSWER") < user.index("SECOND ANSWER")
        assert user.rstrip().endswith('Preferred: <"A" or "B">')
        assert len(template.hash) == 16 and template.version == "1"
    assert load_template("tldr").hash != load_template("helpfulness").hash


def test_placeholder_text_inside_answers_is_not_substituted():
    user = load_template("tldr").render("post {answer_b}", "says {prompt}", "plain")[-1]["content"]
    assert "post {answer_b}" in user and "says {prompt}" in user


def test_a_custom_template_file_is_loaded_and_hashed_by_content(tmp_path):
    path = tmp_path / "mine.yaml"
    body = """\
        name: terse
        version: 3
        system: You are a strict judge.
        user: "Q: {prompt}\\nA: {answer_a}\\nB: {answer_b}\\nEnd with Verdict: A or Verdict: B"
        verdict_prefix: Verdict
    """
    path.write_text(textwrap.dedent(body))
    template = load_template(str(path))
    assert (template.name, template.version, template.verdict_prefix) == ("terse", "3", "Verdict")
    assert template.render("p", "a", "b")[0] == {"role": "system", "content": "You are a strict judge."}
    assert "Verdict: A" in template.reask_text
    first = template.hash
    path.write_text(textwrap.dedent(body).replace("strict", "lenient"))
    assert load_template(str(path)).hash != first


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ("user: 'Compare {answer_a} and {answer_b}'", "lacks {prompt}"),
        ("system: hi", "no `user` text"),
        ("user: '{prompt} {answer_a} {answer_b}'\ncolour: red", "unknown fields"),
    ],
)
def test_bad_template_files_are_config_errors(tmp_path, body, expected):
    path = tmp_path / "t.yaml"
    path.write_text(body)
    with pytest.raises(ConfigError, match=expected):
        load_template(str(path))
    with pytest.raises(ConfigError, match="neither a built-in template"):
        load_template(str(tmp_path / "missing.yaml"))


def test_cache_keys_cover_judge_identity_and_slot_order():
    identity = {"backend": "openai", "model": "m", "template": "t1", "temperature": 0.0}
    pair = SlotPair("p", "x", "y")
    key = cache_key(identity, pair)
    assert key == cache_key(dict(identity), SlotPair("p", "x", "y"))
    assert key != cache_key(identity, SlotPair("p", "y", "x"))  # the order is part of the key
    for change in ({"model": "m2"}, {"template": "t2"}, {"temperature": 0.7}):
        assert key != cache_key({**identity, **change}, pair)


def test_cache_stores_raw_text_in_wal_mode_and_skips_api_errors(tmp_path):
    identity = {"backend": "openai", "model": "m", "template": "t"}
    ok = Judgment("ok", "B", ["Comparison: x\nPreferred: B"], 120, 14, 1)
    failed = Judgment("api_error", error="HTTP 500")
    with JudgmentCache(tmp_path / "c.sqlite") as cache:
        cache.put("k1", identity, "t", SlotPair("p", "a", "b"), ok)
        cache.put("k2", identity, "t", SlotPair("p", "b", "a"), failed)
        assert cache.count() == 1
        assert cache.get_many(["k1", "k2", "k3"]) == {"k1": ok}
    with closing(sqlite3.connect(tmp_path / "c.sqlite")) as db:
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        (raw,) = db.execute("SELECT raw_texts FROM judgments").fetchone()
    assert parse_verdict(json.loads(raw)[-1]) == "B"  # re-parseable offline


def test_prompt_ids_are_stable_hashes_of_the_prompt(tmp_path):
    assert prompt_id("hello") == prompt_id("hello") != prompt_id("hello ")
    messages = [{"role": "user", "content": "hi"}]
    assert prompt_id(messages) == prompt_id([{"content": "hi", "role": "user"}])
    path = tmp_path / "c.jsonl"
    path.write_text('{"prompt": "hello", "completion": "x"}\n{"prompt_id": "abc", "completion": "y"}\n')
    assert load_completions(path) == {prompt_id("hello"): "x", "abc": "y"}
    path.write_text('{"prompt": "hello", "prompt_id": "wrong", "completion": "x"}\n')
    with pytest.raises(ConfigError, match="does not match the hash"):
        load_completions(path)
