"""`judge.verdict: logprobs` (issue 41): AlpacaEval 2's weighted verdict, P(A) / (P(A) + P(B)) of the reply's first
token, against the fake judge server answering with `logprobs`."""

from __future__ import annotations

import asyncio
import math
import threading

import pytest

from rloo_engine.evaluation import ConfigError, JudgeEndpointError, run_evaluation
from rloo_engine.evaluation.budget import SpendTracker
from rloo_engine.evaluation.cache import cache_key
from rloo_engine.evaluation.config import build_eval_config
from rloo_engine.evaluation.judges import build_judge
from rloo_engine.evaluation.judges.base import SlotPair
from rloo_engine.evaluation.judges.logprob_verdict import hard_verdict, slot_a_probability
from rloo_engine.evaluation.templates import load_template
from rloo_engine.testing.fake_openai_server import FakeReply, letter_logprobs, sensible
from tests.evaluation.eval_helpers import config_values

SOFT = {"verdict": "logprobs", "template": "tldr_letter"}
POLICY_VS_REFERENCE = {"pairings": ["policy_vs_reference"], "both_orders_rule": "average"}
BATCH = {"mode": "batch", "batch_poll_initial_s": 0.01, "batch_poll_max_s": 0.05}


def _alternatives(**logprobs: float) -> list[dict]:
    return [{"token": token.replace("_", " "), "logprob": lp} for token, lp in logprobs.items()]


# ---------------------------------------------------------------- the soft preference of one reply
def test_the_soft_preference_is_p_a_over_p_a_plus_p_b_of_the_first_token():
    p = slot_a_probability(_alternatives(A=math.log(0.6), B=math.log(0.2), The=math.log(0.2)))
    assert p == pytest.approx(0.75)
    assert hard_verdict(p) == "A" and hard_verdict(0.25) == "B" and hard_verdict(0.5) == "tie"


def test_spellings_of_one_letter_are_summed_and_a_missing_letter_counts_as_zero():
    # " A" and "A" are two tokens of one answer; B outside the top k has probability 0, as in AlpacaEval
    assert slot_a_probability(_alternatives(A=math.log(0.3), _A=math.log(0.3), B=math.log(0.2))) == pytest.approx(0.75)
    assert slot_a_probability(_alternatives(_B=math.log(0.9), Both=math.log(0.1))) == 0.0
    assert slot_a_probability(_alternatives(Comparison=-0.1, The=-2.5)) is None
    assert slot_a_probability(_alternatives(a=-0.1, b=-2.5)) is None  # lower case is not the asked letter


def test_two_unlikely_letters_do_not_underflow():
    assert slot_a_probability(_alternatives(A=-800.0, B=-800.0 - math.log(3))) == pytest.approx(0.75)


# ---------------------------------------------------------------- end to end against the fake server
def _recording(behaviour, bodies: list[dict]):
    lock = threading.Lock()

    def answer(req):
        with lock:
            bodies.append(req.body)
        return behaviour(req)

    return answer


def test_the_prompt_score_is_the_mean_soft_preference_of_its_two_orders(fake_server, make_config):
    bodies: list[dict] = []
    server = fake_server(_recording(sensible, bodies))  # P(better letter) = 0.9 in every order
    report = run_evaluation(make_config(server, judge=SOFT, **POLICY_VS_REFERENCE))
    r = report.pairings["policy_vs_reference"]
    assert r.win_rate == pytest.approx((7 * 0.9 + 3 * 0.1) / 10)  # the hard rate would be 0.7
    assert (r.n_win, r.n_loss, r.n_tie) == (14, 6, 0)  # W/L/T count each order's hard (argmax) verdict
    assert r.consistency_rate == 1.0
    assert {(b["logprobs"], b["top_logprobs"], b["max_tokens"]) for b in bodies} == {(True, 20, 1)}
    assert report.judge["verdict"] == "logprobs"
    rows = report.table()
    assert len(rows) == 20 and {row["raw_verdict"] for row in rows} == {"A", "B"}
    for row in rows:
        policy_better = row["completion_a"].startswith("a good")
        assert row["soft_preference"] == pytest.approx(0.9 if policy_better else 0.1)
        slot_of_policy = "A" if row["order"] == "ab" else "B"
        assert (row["parsed_verdict"] == slot_of_policy) == policy_better


def _slot_a_leaning(req) -> FakeReply:
    """P(slot A) = 0.8 when the policy's answer ("a good ...") is in slot A, 0.6 when the reference is: a judge that
    likes the policy and slot A."""
    p_a = 0.8 if req.answer_a.startswith("a good") else 0.6
    return FakeReply(text="A", logprobs=letter_logprobs({"A": p_a, "B": 1 - p_a}))


def test_the_swapped_order_scores_one_minus_the_slot_a_probability(fake_server, make_config):
    server = fake_server(_slot_a_leaning)
    report = run_evaluation(make_config(server, judge=SOFT, max_prompts=7, **POLICY_VS_REFERENCE))
    # order ab: the policy in slot A, 0.8; order ba: the reference in slot A with 0.6, so the policy's 0.4
    assert report.pairings["policy_vs_reference"].win_rate == pytest.approx((0.8 + 0.4) / 2)
    scores = {row["order"]: row["soft_preference"] for row in report.table()}
    assert scores == {"ab": pytest.approx(0.8), "ba": pytest.approx(0.4)}
    assert {row["parsed_verdict"] for row in report.table()} == {"A"}  # both argmaxes say A: inconsistent
    assert report.pairings["policy_vs_reference"].consistency_rate == 0.0


def test_single_order_mode_scores_the_one_order_softly(fake_server, make_config):
    server = fake_server(_slot_a_leaning)
    cfg = make_config(server, judge=SOFT, order_mode="single", max_prompts=7, pairings=["policy_vs_reference"])
    report = run_evaluation(cfg)  # both_orders_rule (agree by default) plays no part with one order
    expected = [0.8 if row["order"] == "ab" else 0.4 for row in report.table()]
    assert report.pairings["policy_vs_reference"].win_rate == pytest.approx(sum(expected) / len(expected))


def test_a_reply_without_logprobs_stops_the_run_at_once_naming_the_endpoint(fake_server, make_config):
    server = fake_server(lambda req: FakeReply(text="A"))  # a server that ignores `logprobs: true`
    with pytest.raises(JudgeEndpointError) as err:
        run_evaluation(make_config(server, judge={**SOFT, "max_concurrency": 1}, **POLICY_VS_REFERENCE))
    message = str(err.value)
    assert server.base_url in message and "no log-probabilities" in message and "top_logprobs" in message
    assert "judge.verdict: text" in message
    assert server.request_count == 1  # not 20 judgments' worth, nor retried


def test_replies_without_either_letter_stop_the_run_after_the_first_few(fake_server, make_config):
    prose = letter_logprobs({"Comparison": 0.7, "The": 0.2, "Summary": 0.1})
    server = fake_server(lambda req: FakeReply(text="Comparison", logprobs=prose))
    with pytest.raises(JudgeEndpointError) as err:
        run_evaluation(make_config(server, judge={**SOFT, "max_concurrency": 1}, **POLICY_VS_REFERENCE))
    message = str(err.value)
    assert "the first 3 replies" in message and "neither `A` nor `B`" in message and "'Comparison' (p=0.70)" in message
    assert server.base_url in message and "tldr_letter" in message
    assert server.request_count == 3


def test_one_letterless_reply_after_good_ones_is_a_counted_parse_error(fake_server, make_config):
    def odd_on_post_9(req):
        if "Post 9:" in req.body["messages"][-1]["content"]:
            return FakeReply(text="**", logprobs=letter_logprobs({"**": 0.9, "The": 0.1}))
        return sensible(req)

    server = fake_server(odd_on_post_9)
    report = run_evaluation(make_config(server, judge={**SOFT, "max_concurrency": 1}, **POLICY_VS_REFERENCE))
    r = report.pairings["policy_vs_reference"]
    assert (r.n_valid, r.n_parse_error) == (9, 1)
    (row, _) = [row for row in report.table() if row["status"] == "parse_error"]
    assert "neither `A` nor `B`" in row["error"] and server.base_url in row["error"]
    assert row["soft_preference"] is None


def test_the_cache_keeps_soft_verdicts_apart_and_restores_them(fake_server, make_config):
    server = fake_server("sensible")
    cfg = make_config(server, judge=SOFT, max_prompts=4, **POLICY_VS_REFERENCE)
    first = run_evaluation(cfg)
    again = run_evaluation(cfg)
    assert again.usage.requests == 0 and again.usage.judgments_cached == 8
    assert again.pairings["policy_vs_reference"].win_rate == first.pairings["policy_vs_reference"].win_rate
    assert [row["soft_preference"] for row in again.table()] == [row["soft_preference"] for row in first.table()]
    other_k = run_evaluation(make_config(server, judge={**SOFT, "top_logprobs": 5}, max_prompts=4,
                                         **POLICY_VS_REFERENCE))
    assert other_k.usage.judgments_cached == 0 and other_k.usage.requests == 8


async def _identity(**judge_values) -> dict:
    judge = {"backend": "openai", "model": "m", "base_url": "http://127.0.0.1:1/v1", "api_key_env": None,
             "template": "tldr_letter", **judge_values}
    cfg = build_eval_config({"prompts": "p.jsonl", "judge": judge, "both_orders_rule": "average"})
    built = build_judge(cfg.judge, load_template(cfg.judge.template), SpendTracker(None, None, "m"))
    try:
        return built.identity()
    finally:
        await built.aclose()


def test_the_cache_key_includes_the_verdict_mode_and_text_keys_are_unchanged():
    text = asyncio.run(_identity(max_tokens=256))
    soft = asyncio.run(_identity(verdict="logprobs", max_tokens=256))
    assert "verdict" not in text  # keys cached by text verdicts before this mode existed still match
    assert soft == {**text, "verdict": "logprobs", "top_logprobs": 20}
    pair = SlotPair("p", "a", "b")
    assert cache_key(text, pair) != cache_key(soft, pair)


# ---------------------------------------------------------------- what is refused before any request
@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({"judge": {"backend": "hf", "model": "x", "verdict": "logprobs"}}, "judge.verdict: 'logprobs' with backend 'hf'"),
        ({"judge": SOFT}, "both_orders_rule: 'agree' with judge.verdict 'logprobs'"),
        ({"judge": {**SOFT, "extra_body": {"top_logprobs": 5}}, "both_orders_rule": "average"},
         "judge.extra_body: sets ['top_logprobs'] with verdict 'logprobs'"),
        ({"judge": {**SOFT, "top_logprobs": 50}, "both_orders_rule": "average"}, "judge.top_logprobs"),
    ],
)
def test_logprobs_verdict_options_are_validated(eval_files, tmp_path, api_key, overrides, expected):
    values = config_values(eval_files, "http://127.0.0.1:1/v1", tmp_path / "out")
    values["judge"].update(overrides.pop("judge"))
    values.update(overrides)
    with pytest.raises(ConfigError, match=expected.replace("[", r"\[").replace("]", r"\]")):
        build_eval_config(values)


@pytest.mark.parametrize(
    ("judge", "expected"),
    [
        ({"verdict": "logprobs", "template": "tldr"}, "judge.template: 'tldr' has reply_format 'verdict_line', and "
                                                      "judge.verdict: 'logprobs'"),
        ({"template": "helpfulness_letter"}, "judge.template: 'helpfulness_letter' has reply_format 'letter', and "
                                             "judge.verdict: 'text'"),
    ],
)
def test_a_template_that_does_not_fit_the_verdict_mode_is_refused_before_any_request(
    fake_server, make_config, judge, expected
):
    server = fake_server("sensible")
    with pytest.raises(ConfigError, match=expected):
        run_evaluation(make_config(server, judge=judge, both_orders_rule="average"))
    assert server.request_count == 0


# ---------------------------------------------------------------- the Batch API path
def test_batch_mode_reads_soft_verdicts_like_live(fake_server, make_config):
    server = fake_server("sensible")
    report = run_evaluation(make_config(server, judge={**SOFT, **BATCH}, **POLICY_VS_REFERENCE))
    assert report.pairings["policy_vs_reference"].win_rate == pytest.approx(0.66)
    assert server.request_count == 0 and server.batch_api.batches_created == 1
    rows = list(server.batch_api.batches.values())[0].rows
    assert {(row["body"]["logprobs"], row["body"]["top_logprobs"]) for row in rows} == {(True, 20)}


def test_batch_rows_without_logprobs_stop_the_run_once_collected(fake_server, make_config):
    server = fake_server(lambda req: FakeReply(text="A"))
    with pytest.raises(JudgeEndpointError, match="no log-probabilities"):
        run_evaluation(make_config(server, judge={**SOFT, **BATCH, "batch_unfinished": "live"},
                                   **POLICY_VS_REFERENCE))
    assert server.request_count == 0  # the failed rows were not judged live again


def test_reply_format_is_read_from_the_template_file_and_validated(tmp_path):
    assert {load_template(n).reply_format for n in ("tldr_letter", "helpfulness_letter")} == {"letter"}
    assert load_template("tldr").reply_format == "verdict_line"
    path = tmp_path / "t.yaml"
    path.write_text("user: '{prompt} {answer_a} {answer_b}'\nreply_format: sentence\n")
    with pytest.raises(ConfigError, match="reply_format 'sentence'; expected one of verdict_line, letter"):
        load_template(str(path))
