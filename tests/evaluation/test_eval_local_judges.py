"""The python, reward_model and hf judges, pairing rules that need no judge call, and the output table."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

from rloo_engine.evaluation import EvalConfig, JudgeConfig, run_evaluation
from rloo_engine.evaluation.judges.base import SlotPair
from rloo_engine.evaluation.judges.hf_judge import HFJudge
from rloo_engine.evaluation.judges.python_judge import PythonJudge
from rloo_engine.evaluation.judges.reward_model_judge import RewardModelJudge
from rloo_engine.evaluation.report import TABLE_COLUMNS
from rloo_engine.evaluation.result_checks import UntrustworthyResultError
from rloo_engine.evaluation.templates import load_template
from tests.evaluation.eval_helpers import write_jsonl

PAIRS = [
    SlotPair("the post", "a long detailed answer", "short"),
    SlotPair("the post", "short", "a long detailed answer"),
    SlotPair("another post", "same", "same"),
]


def _python_judge(function: str, **kw) -> PythonJudge:
    return PythonJudge(JudgeConfig(backend="python", function=f"tests.evaluation.eval_helpers:{function}", **kw))


@pytest.mark.parametrize(
    ("function", "batched"),
    [("prefer_longer", False), ("prefer_longer_batched", True), ("prefer_longer_async", False)],
)
def test_python_judge_forms_agree(function, batched):
    seen = []
    judgments = asyncio.run(_python_judge(function, batched=batched).judge(PAIRS, lambda i, j: seen.append(i)))
    assert [j.verdict for j in judgments] == ["A", "B", "tie"]
    assert all(j.status == "ok" for j in judgments) and seen == [0, 1, 2]


def test_python_judge_text_and_bad_values():
    assert asyncio.run(_python_judge("verbose_rule").judge(PAIRS[:1]))[0].verdict == "B"
    unsure = asyncio.run(_python_judge("unsure_rule").judge(PAIRS[:1]))[0]
    assert (unsure.status, unsure.verdict, unsure.raw_texts) == ("parse_error", None, ["maybe"])
    with pytest.raises(RuntimeError, match="bug in the rule"):
        asyncio.run(_python_judge("broken_rule").judge(PAIRS[:1]))


def test_python_judge_identity_changes_with_the_function():
    assert _python_judge("prefer_longer").identity() != _python_judge("verbose_rule").identity()
    assert _python_judge("prefer_longer").identity() == _python_judge("prefer_longer").identity()


def test_a_synchronous_judge_does_not_block_the_event_loop():
    """The rule runs in a worker thread: while it waits, a coroutine on the loop can still run and answer it.
    Ordered by events, not by the clock; on the loop thread the rule would wait out its timeout and say B."""
    from tests.evaluation import eval_helpers

    eval_helpers.RULE_STARTED.clear()
    eval_helpers.LOOP_ANSWERED.clear()
    judge = _python_judge("handshake_rule")

    async def main():
        async def answer_the_rule() -> None:
            await asyncio.to_thread(eval_helpers.RULE_STARTED.wait, 60)
            eval_helpers.LOOP_ANSWERED.set()

        answering = asyncio.create_task(answer_the_rule())
        judgments = await judge.judge([PAIRS[0]])
        await answering
        return judgments

    (judgment,) = asyncio.run(main())
    assert judgment.verdict == "A"


def test_reward_model_judge_compares_scores_with_a_tie_margin(reward_model):
    judge = RewardModelJudge(JudgeConfig(backend="reward_model", model=str(reward_model), batch_size=2))
    judgments = asyncio.run(judge.judge(PAIRS))
    scores = judge.score([p.prompt for p in PAIRS] * 2, [p.answer_a for p in PAIRS] + [p.answer_b for p in PAIRS])
    for k, (pair, j) in enumerate(zip(PAIRS, judgments, strict=True)):
        expected = "tie" if scores[k] == scores[k + 3] else ("A" if scores[k] > scores[k + 3] else "B")
        assert j.verdict == expected, (pair, scores[k], scores[k + 3])
        assert set(json.loads(j.raw_texts[0])) == {"score_A", "score_B"}
    assert {judgments[0].verdict, judgments[1].verdict} == {"A", "B"}  # order-invariant: swapped slots, swapped verdict
    assert judgments[2].verdict == "tie"
    wide = RewardModelJudge(JudgeConfig(backend="reward_model", model=str(reward_model), tie_margin=1e6))
    assert {j.verdict for j in asyncio.run(wide.judge(PAIRS))} == {"tie"}


def test_hf_judge_compares_label_probabilities_batched_like_unbatched(qwen2_model):
    cfg = JudgeConfig(backend="hf", model=str(qwen2_model), template="helpfulness", batch_size=3)
    judge = HFJudge(cfg, load_template("helpfulness"))
    batched = judge.label_logprobs(PAIRS)
    single = [judge.label_logprobs([p])[0] for p in PAIRS]
    assert np.array(batched) == pytest.approx(
        np.array(single), abs=1e-4
    )  # left padding with position ids changes nothing
    judgments = asyncio.run(judge.judge(PAIRS))
    for (lp_a, lp_b), j in zip(batched, judgments, strict=True):
        assert j.verdict == ("A" if lp_a > lp_b else "B")
        assert json.loads(j.raw_texts[0]) == pytest.approx({"logprob_A": lp_a, "logprob_B": lp_b}, abs=1e-4)
    wide = HFJudge(cfg.model_copy(update={"tie_margin": 1e6}), load_template("helpfulness"))
    assert {j.verdict for j in asyncio.run(wide.judge(PAIRS))} == {"tie"}
    assert judge.identity()["template"] == load_template("helpfulness").hash


def _run(tmp_path, policy: dict[str, str], references: dict[str, str], function: str = "recording_rule", **kw):
    prompts = [{"prompt": p, "reference": r} for p, r in references.items()]
    cfg = EvalConfig.model_validate(
        {
            "prompts": str(write_jsonl(tmp_path / "prompts.jsonl", prompts)),
            "reference_column": "reference",
            "policy_completions": str(
                write_jsonl(tmp_path / "policy.jsonl", [{"prompt": p, "completion": c} for p, c in policy.items()])
            ),
            "judge": {"backend": "python", "function": f"tests.evaluation.eval_helpers:{function}"},
            "output_dir": str(tmp_path / "out"),
            "progress": False,
            **kw,
        }
    )
    return run_evaluation(cfg)


def test_identical_answers_are_a_tie_without_a_call(tmp_path):
    from tests.evaluation import eval_helpers

    eval_helpers.CALLS.clear()
    report = _run(tmp_path, {"p1": "same text", "p2": "longer policy text"}, {"p1": "same text", "p2": "ref"})
    r = report.pairings["policy_vs_reference"]
    assert (r.n_identical, r.n_tie, r.n_win, r.win_rate) == (1, 1, 1, 0.75)
    assert ("same text", "same text") not in eval_helpers.CALLS and len(eval_helpers.CALLS) == 2
    assert report.usage.judgments_without_call == 1
    identical_rows = [row for row in report.table() if row["prompt_id"] == report.table()[0]["prompt_id"]]
    assert identical_rows[0]["order"] is None and identical_rows[0]["winner"] == "tie"


def test_prompts_without_a_completion_are_counted_not_dropped(tmp_path):
    # 2 of 3 prompts missing fail the run at the default max_failed_fraction (test_eval_judge_noise_and_missing)
    report = _run(tmp_path, {"p1": "policy answer"}, {"p1": "r", "p2": "r", "p3": "r"}, function="prefer_longer",
                  max_failed_fraction=1.0)
    r = report.pairings["policy_vs_reference"]
    assert (r.n, r.n_missing) == (1, 2)
    assert any("2 prompts lack a completion" in w for w in report.warnings)


def test_parse_errors_are_counted_and_excluded_never_guessed(tmp_path):
    with pytest.raises(UntrustworthyResultError) as err:  # a pairing with no valid judgment fails the run
        _run(tmp_path, {"p1": "a", "p2": "b"}, {"p1": "c", "p2": "d"}, function="unsure_rule")
    r = err.value.report.pairings["policy_vs_reference"]
    assert (r.n, r.n_valid, r.n_parse_error, r.win_rate, r.se, r.ci_low) == (2, 0, 2, None, None, None)


@pytest.mark.filterwarnings("ignore:For backward compatibility:Warning")  # raised inside mlflow with pandas 3
def test_the_table_is_ready_for_mlflow_log_table(tmp_path, monkeypatch):
    report = _run(
        tmp_path, {"p1": "policy answer", "p2": "x"}, {"p1": "ref", "p2": "reference"}, function="prefer_longer"
    )
    columns = report.table_columns()
    assert tuple(columns) == TABLE_COLUMNS and all(len(v) == 4 for v in columns.values())  # 2 prompts x 2 orders
    row = report.table()[0]
    assert row["pairing"] == "policy_vs_reference" and row["order"] in ("ab", "ba")
    assert row["status"] == "ok" and row["winner"] in ("policy", "reference")
    assert report.dataframe().shape == (4, len(TABLE_COLUMNS))

    mlflow = pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    mlflow.set_tracking_uri((tmp_path / "mlruns").as_uri())
    with mlflow.start_run() as run:
        mlflow.log_table(data=columns, artifact_file="judgments.json")
    logged = mlflow.load_table("judgments.json", run_ids=[run.info.run_id])
    assert len(logged) == 4 and set(TABLE_COLUMNS) <= set(logged.columns)


def test_a_reward_model_with_two_labels_is_rejected(tiny_dir, policy_tokenizer):
    from rloo_engine.evaluation import ConfigError
    from rloo_engine.testing.tiny_models import build_reward_model

    path = build_reward_model(tiny_dir / "rm_two_labels", policy_tokenizer, num_labels=2)
    judge = RewardModelJudge(JudgeConfig(backend="reward_model", model=str(path)))
    with pytest.raises(ConfigError, match="judge.model: .*num_labels=2"):
        asyncio.run(judge.judge(PAIRS[:1]))
