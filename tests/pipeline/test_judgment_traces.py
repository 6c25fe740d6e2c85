"""Judged prompts as MLflow traces: grouping of the judgments table (pure; the e2e test reads them back)."""

from rloo_engine.pipeline.judgment_traces import judgment_traces, most_telling_first


def _row(pairing, prompt_id, order, winner, status="ok", raw="reply", error=None):
    return {"pairing": pairing, "prompt_id": prompt_id, "prompt": f"prompt {prompt_id}", "model_a": "policy",
            "model_b": "sft", "completion_a": "a", "completion_b": "a" if order is None else "b", "order": order,
            "status": status, "raw_verdict": raw, "raw_verdict_reask": None, "parsed_verdict": None,
            "winner": winner, "error": error}


def test_each_prompt_is_one_trace_with_a_verdict_per_order_and_its_consistency():
    rows = [_row("policy_vs_sft", "p1", "ab", "policy", raw="A: clearer"), _row("policy_vs_sft", "p1", "ba", "sft"),
            _row("policy_vs_sft", "p2", "ab", "policy"), _row("policy_vs_sft", "p2", "ba", "policy"),
            _row("policy_vs_sft", "p3", None, "tie"),
            _row("policy_vs_sft", "p4", "ab", None, status="parse_error", error="no verdict in reply")]
    traces = {t.tags["prompt_id"]: t for t in judgment_traces(rows)}
    assert set(traces) == {"p1", "p2", "p3", "p4"}
    p1 = traces["p1"]
    assert p1.inputs == {"prompt": "prompt p1", "policy": "a", "sft": "b"}
    assert [(f["name"], f["value"], f["rationale"]) for f in p1.feedback] == [
        ("verdict_ab", "policy", "A: clearer"), ("verdict_ba", "sft", "reply"),
        ("consistent", False, "the two orders picked different winners")]
    assert p1.tags["consistent"] == "false" and traces["p2"].tags["consistent"] == "true"
    assert traces["p3"].tags["identical"] == "true" and traces["p3"].feedback[0]["value"] == "tie"
    assert traces["p4"].tags["status"] == "parse_error" and traces["p4"].feedback[0]["error"] == "no verdict in reply"
    # a cap keeps the failures and the disagreements
    assert [t.tags["prompt_id"] for t in most_telling_first(list(traces.values()), 2)] == ["p4", "p1"]
