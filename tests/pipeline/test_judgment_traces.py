"""Judged prompts as MLflow traces: each prompt's score (its mean is the win rate), truthful sources, an unbiased cap.

The pure tests build judgments-table rows by hand; the slow ones run a real evaluation (python rule, or an
openai judge against the fake chat-completions server), log it with the evaluate task's own `record_report`
on a real `mlflow server`, and read the traces back through MLflow's API.
"""

from __future__ import annotations

import json
import math
import random
import statistics
import uuid
from collections import Counter
from typing import get_args

import pytest

from rloo_engine.evaluation.config import PAIRINGS, EvalConfig, JudgeConfig
from rloo_engine.pipeline import tracking
from rloo_engine.pipeline.config import EvaluationSection
from rloo_engine.pipeline.judgment_traces import (
    COMPUTED_BY,
    JudgmentTrace,
    judge_source_type,
    judgment_traces,
    proportional_quotas,
    sample_tags,
    sample_traces,
    score_name,
)


def _slot(order: str | None, winner: str | None, model_a: str) -> str | None:
    """The slot verdict that picks `winner` when the answers are shown in `order`."""
    if winner in (None, "tie"):
        return winner
    return "A" if (winner == model_a) == (order == "ab") else "B"


def _row(pairing, prompt_id, order, winner, status="ok", raw="reply", error=None):
    model_a, model_b = PAIRINGS[pairing]
    return {"pairing": pairing, "prompt_id": prompt_id, "prompt": f"prompt {prompt_id}", "model_a": model_a,
            "model_b": model_b, "completion_a": "a", "completion_b": "a" if order is None else "b", "order": order,
            "status": status, "raw_verdict": raw, "raw_verdict_reask": None,
            "parsed_verdict": _slot(order, winner, model_a), "winner": winner, "error": error}


def _feedback(trace: JudgmentTrace) -> dict:
    return {f.name: f for f in trace.feedback}


def test_each_prompt_is_one_trace_with_its_score_verdicts_and_consistency():
    rows = [_row("policy_vs_sft", "p1", "ab", "policy", raw="A: clearer"), _row("policy_vs_sft", "p1", "ba", "sft"),
            _row("policy_vs_sft", "p2", "ab", "policy"), _row("policy_vs_sft", "p2", "ba", "policy"),
            _row("policy_vs_sft", "p3", None, "tie"),
            _row("policy_vs_sft", "p4", "ab", None, status="parse_error", error="no verdict in reply"),
            _row("policy_vs_sft", "p4", "ba", "policy"),
            _row("policy_vs_sft", "p5", "ab", "policy"), _row("policy_vs_sft", "p5", "ba", "tie"),
            _row("policy_vs_sft", "p6", "ba", "sft")]  # single-order mode
    traces = {t.tags["prompt_id"]: t for t in judgment_traces(rows, "agree")}
    assert set(traces) == {"p1", "p2", "p3", "p4", "p5", "p6"}
    p1 = traces["p1"]
    assert p1.inputs == {"prompt": "prompt p1", "policy": "a", "sft": "b"}
    assert [(f.name, f.value, f.rationale, f.computed) for f in p1.feedback] == [
        ("verdict_ab", "policy", "A: clearer", False), ("verdict_ba", "sft", "reply", False),
        ("policy_wins_vs_sft", 0.5, "ab: policy, ba: sft (both_orders_rule agree)", True),
        ("consistent", False, "the two orders picked different winners", True)]
    scores = {pid: _feedback(t)["policy_wins_vs_sft"].value for pid, t in traces.items()}
    assert scores == {"p1": 0.5, "p2": 1.0, "p3": 0.5, "p4": None, "p5": 0.5, "p6": 0.0}
    assert p1.tags["consistent"] == "false" and traces["p2"].tags["consistent"] == "true"
    assert traces["p3"].tags["identical"] == "true" and "no judge call" in _feedback(traces["p3"])["policy_wins_vs_sft"].rationale
    # a failed prompt has no score but an error, as it has no place in the win rate
    p4 = _feedback(traces["p4"])
    assert traces["p4"].tags["status"] == "parse_error" and traces["p4"].tags["consistent"] == "n/a"
    assert p4["verdict_ab"].error == "no verdict in reply" and "consistent" not in p4
    assert p4["policy_wins_vs_sft"].error == "no score (ab: parse_error); left out of the win rate"
    assert "consistent" not in _feedback(traces["p6"])
    # the evaluation's both_orders_rule decides the score: `average` counts each order half
    averaged = {t.tags["prompt_id"]: _feedback(t)["policy_wins_vs_sft"].value for t in judgment_traces(rows, "average")}
    assert averaged["p5"] == 0.75 and averaged["p1"] == 0.5


def test_verdicts_are_llm_judge_only_from_a_language_model():
    expected = {"openai": "LLM_JUDGE", "hf": "LLM_JUDGE", "python": "CODE", "reward_model": "CODE"}
    assert set(get_args(JudgeConfig.model_fields["backend"].annotation)) == set(expected)  # a new backend is decided here
    assert {backend: judge_source_type(backend) for backend in expected} == expected
    assert score_name("policy", "reference") == "policy_wins_vs_reference"


# ---------------------------------------------------------------- the cap: a sample, not the failures first


def _synthetic_rows(n_prompts: int = 600, seed: int = 1) -> list[dict]:
    """The audit's shape: 600 prompts x 3 pairings in both orders, a judge that picks slot A 40% of the time
    regardless of content (order disagreements) and fails 3% of its calls (parse errors)."""
    rng = random.Random(seed)
    rows = []
    for (pairing, (model_a, model_b)), a_better in zip(PAIRINGS.items(), (0.95, 0.6, 0.9), strict=True):
        for i in range(n_prompts):
            better = model_a if rng.random() < a_better else model_b
            for order in ("ab", "ba"):
                if rng.random() < 0.03:
                    rows.append(_row(pairing, f"q{i}", order, None, status="parse_error", error="no verdict"))
                    continue
                slot_a = model_a if order == "ab" else model_b
                rows.append(_row(pairing, f"q{i}", order, slot_a if rng.random() < 0.4 else better))
    return rows


def _scores_and_consistency(traces: list[JudgmentTrace]) -> tuple[list[float], list[float]]:
    scores = [f.value for t in traces for f in t.feedback if "_wins_vs_" in f.name and f.value is not None]
    consistent = [float(f.value) for t in traces for f in t.feedback if f.name == "consistent"]
    return scores, consistent


def _within_sampling_error(full: list[float], sample: list[float]) -> bool:
    """|sample mean - full mean| < 3 standard errors of a simple random sample of this size from `full`."""
    if not sample:
        return False
    n, population = len(sample), len(full)
    se = statistics.pstdev(full) / math.sqrt(n) * math.sqrt((population - n) / (population - 1))
    return abs(statistics.mean(sample) - statistics.mean(full)) < 3 * se


def test_a_capped_trace_set_shows_the_full_sets_averages_where_failures_first_did_not():
    traces = judgment_traces(_synthetic_rows(), "agree")
    assert len(traces) == 1800
    full_scores, full_consistent = _scores_and_consistency(traces)
    assert sum(t.tags["status"] != "ok" for t in traces) > 50 and 0.4 < statistics.mean(full_consistent) < 0.7

    sample = sample_traces(traces, 300, seed=0)
    assert len(sample) == 300 and Counter(t.tags["pairing"] for t in sample) == {p: 100 for p in PAIRINGS}
    scores, consistent = _scores_and_consistency(sample)
    assert _within_sampling_error(full_scores, scores) and _within_sampling_error(full_consistent, consistent)

    # The rule this replaced, failures and disagreements first, showed the UI a set far from the run's numbers.
    failures_first = sorted(traces, key=lambda t: (t.tags["status"] == "ok", t.tags["consistent"] != "false"))[:300]
    scores, consistent = _scores_and_consistency(failures_first)
    assert not _within_sampling_error(full_scores, scores) and not _within_sampling_error(full_consistent, consistent)


def test_the_sample_is_seeded_in_random_order_and_its_tags_name_size_total_and_rule():
    traces = judgment_traces(_synthetic_rows(n_prompts=50), "agree")
    names = [t.name for t in sample_traces(traces, 40, seed=3)]
    assert names == [t.name for t in sample_traces(traces, 40, seed=3)] != [t.name for t in sample_traces(traces, 40, 4)]
    # Uncapped, every trace is logged, in an order that mixes the pairings: the UI summarizes its newest 100.
    logged = sample_traces(traces, 150, seed=3)
    assert sorted(t.name for t in logged) == sorted(t.name for t in traces)
    assert Counter(t.tags["pairing"] for t in logged[:30]).keys() == set(PAIRINGS)
    assert proportional_quotas({"a": 5, "b": 3, "c": 2}, 7) == {"a": 4, "b": 2, "c": 1}
    assert sample_tags(150, 150, seed=3)["evaluation.judgment_traces.sample"] == "every judged prompt"
    tags = sample_tags(40, 150, seed=3)
    assert tags["evaluation.judgment_traces"] == "40" and tags["evaluation.judgment_traces.total"] == "150"
    assert "uniform random sample of 40 of 150" in tags["evaluation.judgment_traces.sample"]
    assert "seed 3" in tags["evaluation.judgment_traces.sample"]


# ---------------------------------------------------------------- logged on a real MLflow server


N_PROMPTS = 10
# Each pairing's score per prompt i under the marker rule below (both orders, rule agree); None: the prompt failed.
# 4-5: "[first]" makes the judge pick slot A in both orders, a disagreement and so a tie; 6: the judge's reply does
# not parse; 7: policy's answer is the reference itself, a tie without a call.
EXPECTED_SCORES = {
    "policy_vs_reference": [1, 1, 1, 1, 0.5, 0.5, None, 0.5, 0, 1],
    "sft_vs_reference": [0, 0, 0, 0, 0, 0, 0, 0, 0, 1],
    "policy_vs_sft": [1, 1, 1, 1, 0.5, 0.5, None, 1, 1, 0],
}


def marker_rule(prompt: str, answer_a: str, answer_b: str) -> str:
    """The python judge of these tests: "[garble]" gets no verdict, a lone "[win]" wins, "[first]" gets slot A,
    otherwise the longer answer wins."""
    if "[garble]" in answer_a + answer_b:
        return "I would rather not say."
    if ("[win]" in answer_a) != ("[win]" in answer_b):
        return "A" if "[win]" in answer_a else "B"
    if "[first]" in answer_a + answer_b:
        return "A"
    return "A" if len(answer_a) >= len(answer_b) else "B"


def _marker_reply(request):
    """The same rule as an LLM judge's chat reply (the fake OpenAI server's behaviour)."""
    from rloo_engine.testing.fake_openai_server import FakeReply, verdict_text

    verdict = marker_rule("", request.answer_a, request.answer_b)
    return FakeReply(text=verdict_text(verdict) if verdict in ("A", "B") else verdict)


def _write_eval_files(root) -> dict[str, str]:
    prompts = [f"Post {i}: the cat sat on mat {i}. TL;DR:" for i in range(N_PROMPTS)]
    references = [f"reference text {i}" for i in range(N_PROMPTS)]
    references[8] = "[win] reference 8"
    policy = [f"[win] policy {i}" for i in range(4)] + ["[first] policy 4", "[first] policy 5",
                                                       "[garble] policy 6", references[7],
                                                       "policy 8 is a long answer", "policy 9 is a long answer"]
    sft = [f"sft {i}" for i in range(N_PROMPTS - 1)] + ["[win] sft 9"]
    files = {"prompts": [{"prompt": p, "reference": r} for p, r in zip(prompts, references, strict=True)],
             "policy": [{"prompt": p, "completion": c} for p, c in zip(prompts, policy, strict=True)],
             "sft": [{"prompt": p, "completion": c} for p, c in zip(prompts, sft, strict=True)]}
    for name, rows in files.items():
        (root / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {name: str(root / f"{name}.jsonl") for name in files}


def _evaluate_and_record(services, tmp_path, judge: dict, trace_judgments: int) -> tracking.RunRef:
    """A real evaluation of the marker set, recorded on a fresh evaluate run by the evaluate task's own code."""
    from rloo_engine.evaluation import run_evaluation
    from tasks.evaluate import record_report

    section = EvaluationSection(judge=judge, trace_judgments=trace_judgments)
    files = _write_eval_files(tmp_path)
    cfg = EvalConfig(prompts=files["prompts"], reference_column="reference", policy_completions=files["policy"],
                     sft_completions=files["sft"], judge=section.judge.model_dump(), output_dir=str(tmp_path / "eval"),
                     order_mode=section.order_mode, both_orders_rule=section.both_orders_rule, seed=section.seed,
                     max_failed_fraction=0.5, min_consistency=0.0, bootstrap_resamples=1000)
    report = run_evaluation(cfg)
    parent = tracking.parent_run(services.mlflow_uri, "judgment-traces", str(uuid.uuid4()), "pipeline", {})
    with tracking.stage_run(parent, "evaluate") as run:
        record_report(run, section, report)
    return run


@pytest.mark.slow
@pytest.mark.parametrize(
    ("judge_kind", "cap"), [("python", 1000), ("openai", 12)], ids=["python-rule-all-traces", "llm-judge-capped-at-12"]
)
def test_each_trace_carries_its_score_and_the_run_its_mean_as_the_win_rate(
    services, tmp_path, monkeypatch, judge_kind, cap
):
    from rloo_engine.testing.fake_openai_server import FakeOpenAIServer

    if judge_kind == "python":
        judge = {"backend": "python", "function": "tests.pipeline.test_judgment_traces:marker_rule"}
        run = _evaluate_and_record(services, tmp_path, judge, trace_judgments=cap)
    else:
        monkeypatch.setenv("RLOO_TEST_JUDGE_KEY", "sk-test-judgment-traces")
        with FakeOpenAIServer(_marker_reply) as server:
            judge = {"backend": "openai", "model": "fake-judge", "base_url": server.base_url,
                     "api_key_env": "RLOO_TEST_JUDGE_KEY", "max_attempts": 2, "backoff_initial_s": 0.01}
            run = _evaluate_and_record(services, tmp_path, judge, trace_judgments=cap)

    client = services.mlflow()
    evaluate = client.get_run(run.run_id)
    traces = client.search_traces(locations=[run.experiment_id], run_id=run.run_id, max_results=100)
    total = N_PROMPTS * len(PAIRINGS)
    logged = min(cap, total)
    assert len(traces) == logged == int(evaluate.data.tags["evaluation.judgment_traces"])
    assert evaluate.data.tags["evaluation.judgment_traces.total"] == str(total)
    judge_source = ("LLM_JUDGE", "fake-judge") if judge_kind == "openai" else ("CODE", judge["function"])

    scores: dict[str, list[float]] = {p: [] for p in PAIRINGS}
    for trace in traces:
        pairing = trace.info.tags["pairing"]
        index = int(json.loads(trace.data.request)["prompt"].split(":")[0].removeprefix("Post "))
        feedback = {a.name: a for a in trace.info.assessments}
        score = feedback[score_name(*PAIRINGS[pairing])]
        expected = EXPECTED_SCORES[pairing][index]
        assert (score.source.source_type, score.source.source_id) == ("CODE", COMPUTED_BY)
        if expected is None:
            assert score.value is None and "parse_error" in score.error.error_message, (pairing, index)
        else:
            assert score.value == expected and score.error is None, (pairing, index)
            scores[pairing].append(score.value)
        for name, assessment in feedback.items():
            source = (assessment.source.source_type, assessment.source.source_id)
            assert source == (judge_source if name.startswith("verdict_") else ("CODE", COMPUTED_BY)), name
        assert ("consistent" in feedback) == (trace.info.tags["consistent"] != "n/a")

    if logged < total:
        assert Counter(t.info.tags["pairing"] for t in traces) == {p: 4 for p in PAIRINGS}
        assert "uniform random sample of 12 of 30" in evaluate.data.tags["evaluation.judgment_traces.sample"]
        return
    assert evaluate.data.tags["evaluation.judgment_traces.sample"] == "every judged prompt"
    for pairing, values in scores.items():
        # the headline metric is on the run that holds the traces, and it is their feedback's mean
        assert evaluate.data.metrics[f"{pairing}/win_rate"] == pytest.approx(statistics.mean(values)), pairing
        assert statistics.mean(values) == pytest.approx(statistics.mean(
            s for s in EXPECTED_SCORES[pairing] if s is not None))
