"""Reference-guided judging (issue 41): a template with `{reference}` is shown each prompt's gold answer from
`reference_answer_column`, as MT-Bench's pairwise reference-guided judge is."""

from __future__ import annotations

import threading

import pytest

from rloo_engine.evaluation import ConfigError, run_evaluation
from rloo_engine.evaluation.cache import cache_key
from rloo_engine.evaluation.judges.base import SlotPair
from rloo_engine.evaluation.preflight import check_inputs
from rloo_engine.evaluation.templates import BUILTIN, load_template
from rloo_engine.testing.fake_openai_server import sensible
from tests.evaluation.eval_helpers import write_jsonl

GUIDED = {"judge": {"template": "math_reference"}, "reference_answer_column": "answer",
          "pairings": ["policy_vs_reference"]}


def _prompts_with_answers(eval_files, answers: dict[int, str | None]) -> str:
    """The eval set's prompts file with an `answer` column: `answers[i]` for prompt i (absent: no key)."""
    rows = []
    for i, (prompt, reference) in enumerate(eval_files.references.items()):
        row = {"prompt": prompt, "reference": reference}
        if i in answers:
            row["answer"] = answers[i]
        rows.append(row)
    return str(write_jsonl(eval_files.root / "prompts_with_answers.jsonl", rows))


def _recording(bodies: list[dict]):
    lock = threading.Lock()

    def answer(req):
        with lock:
            bodies.append(req.body)
        return sensible(req)

    return answer


def _shown_reference(body: dict) -> str:
    user = body["messages"][-1]["content"]
    return user.split("Reference answer (correct):\n", 1)[1].split("\n\nResponse A:", 1)[0]


def test_the_judge_is_shown_each_prompts_gold_answer(fake_server, make_config, eval_files):
    answers = {i: f"gold {i} {{answer_b}}" for i in range(10)}  # placeholder-like text is shown as it is
    bodies: list[dict] = []
    server = fake_server(_recording(bodies))
    report = run_evaluation(make_config(server, prompts=_prompts_with_answers(eval_files, answers), **GUIDED))
    assert report.pairings["policy_vs_reference"].win_rate == 0.7
    assert len(bodies) == 20
    for body in bodies:
        user = body["messages"][-1]["content"]
        post = int(user.split("Post ", 1)[1].split(":", 1)[0])
        assert _shown_reference(body) == answers[post]
    assert bodies[0]["messages"][0]["role"] == "system"  # the built-in template's judging instructions
    assert report.judge["reference_answers"] == {"column": "answer", "prompts": 10, "prompts_without": 0}
    assert not [w for w in report.warnings if "reference answer" in w]


def test_a_changed_reference_answer_is_judged_again(fake_server, make_config, eval_files):
    server = fake_server("sensible")
    answers = {i: f"gold {i}" for i in range(10)}
    run_evaluation(make_config(server, prompts=_prompts_with_answers(eval_files, answers), **GUIDED))
    sent = server.request_count
    answers[3] = "a corrected gold answer"
    again = run_evaluation(make_config(server, prompts=_prompts_with_answers(eval_files, answers), **GUIDED))
    assert server.request_count - sent == 2  # prompt 3's two orders; the other 18 judgments are cached
    assert again.usage.judgments_cached == 18


def test_the_cache_key_covers_the_reference_and_is_unchanged_without_one():
    identity = {"backend": "openai", "model": "m"}
    plain = SlotPair("p", "a", "b")
    assert cache_key(identity, plain) == cache_key(identity, SlotPair("p", "a", "b", None))
    assert len({cache_key(identity, SlotPair("p", "a", "b", r)) for r in (None, "", "42", "43")}) == 4


def test_prompts_without_a_gold_answer_are_left_out_and_counted(fake_server, make_config, eval_files):
    answers = {i: f"gold {i}" for i in range(7)}
    answers.update({7: None, 8: "   "})  # no value, a blank value; prompt 9 has no `answer` key at all...
    rows_file = _prompts_with_answers(eval_files, answers)
    server = fake_server("sensible")
    with pytest.raises(ConfigError, match="reference_answer_column: 'answer' is not a column of .* \\(row 9 has"):
        run_evaluation(make_config(server, prompts=rows_file, **GUIDED))  # ...which is an error, as for any column
    answers[9] = None
    report = run_evaluation(make_config(server, prompts=_prompts_with_answers(eval_files, answers), **GUIDED))
    r = report.pairings["policy_vs_reference"]
    assert (r.n, r.n_missing, r.win_rate) == (7, 0, 1.0)  # the policy wins the first 7 prompts
    assert server.request_count == 14
    assert report.judge["reference_answers"] == {"column": "answer", "prompts": 7, "prompts_without": 3}
    (warning,) = [w for w in report.warnings if "reference answer" in w]
    assert "3 of 10 eval prompts" in warning and "'answer'" in warning and "leaves them out" in warning


def test_a_column_of_no_gold_answers_is_refused_before_any_request(fake_server, make_config, eval_files):
    server = fake_server("sensible")
    cfg = make_config(server, prompts=_prompts_with_answers(eval_files, dict.fromkeys(range(10))), **GUIDED)
    with pytest.raises(ConfigError, match="reference_answer_column: 'answer' is empty in every row"):
        check_inputs(cfg)  # the pipeline's check before training
    with pytest.raises(ConfigError, match="reference_answer_column: 'answer' is empty in every row"):
        run_evaluation(cfg)
    assert server.request_count == 0


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({"judge": {"template": "math_reference"}},
         "judge.template: 'math_reference' shows each prompt's reference answer .* reference_answer_column is not set"),
        ({"reference_answer_column": "answer"},
         "reference_answer_column: 'answer' is set, and judge.template 'tldr' has no {reference}"),
        ({"reference_answer_column": "answer", "judge": {"backend": "python", "function": "x:y", "model": None}},
         "reference_answer_column: 'answer' is set, and the python judge uses no template"),
    ],
)
def test_a_template_and_reference_answers_that_do_not_match_are_config_errors(
    fake_server, make_config, overrides, expected
):
    server = fake_server("sensible")
    with pytest.raises(ConfigError, match=expected):
        run_evaluation(make_config(server, **overrides))
    assert server.request_count == 0


def test_the_builtin_reference_template_renders_the_reference_between_question_and_answers():
    template = load_template("math_reference")
    assert BUILTIN["math_reference"] == "math_reference_v1.yaml" and template.needs_reference
    assert not load_template("tldr").needs_reference
    system, user = template.render("What is 6 x 7?", "42", "41", "6 x 7 = 42")
    assert system["role"] == "system" and "reference answer" in system["content"]
    content = user["content"]
    assert content.index("What is 6 x 7?") < content.index("6 x 7 = 42") < content.index("Response A:\n42")
    assert content.rstrip().endswith('Preferred: <"A" or "B">')
    with pytest.raises(ValueError, match="none was given"):
        template.render("q", "a", "b")


def test_the_pipeline_evaluation_section_passes_reference_answer_column_on():
    from rloo_engine.pipeline.config import EvaluationSection

    assert EvaluationSection.model_fields["reference_answer_column"].description.startswith("Column of the prompt set")
