"""Each judged prompt as an MLflow trace with assessments, the way MLflow 3 shows GenAI evaluations.

The judgments table (`judgments.json`) holds every verdict, but the MLflow UI shows a table artifact as
rows to scroll. As traces, each judged prompt is one entry of the evaluate run's Traces tab: the
prompt and both answers as inputs, the per-order verdicts as outputs, one `verdict_<order>` feedback
per judged order (value: the winning model, rationale: the judge's own reply) and a `consistent`
feedback when both orders were judged. Tags (`pairing`, `status`, `consistent`, `identical`) make
the disagreements one filter away: `tags.consistent = 'false'`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

TRACE_SPAN_TYPE = "EVALUATOR"


@dataclass
class JudgmentTrace:
    """What one judged prompt of one pairing becomes: a trace and its feedback."""

    name: str
    inputs: dict[str, Any]
    outputs: dict[str, Any]
    tags: dict[str, str]
    feedback: list[dict[str, Any]] = field(default_factory=list)  # name, value, rationale, error


def judgment_traces(rows: Iterable[dict[str, Any]]) -> list[JudgmentTrace]:
    """Groups judgments-table rows (one per order) into one JudgmentTrace per (pairing, prompt)."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row["pairing"], row["prompt_id"]), []).append(row)
    return [_trace(pairing, prompt_id, group) for (pairing, prompt_id), group in groups.items()]


def _trace(pairing: str, prompt_id: str, rows: list[dict[str, Any]]) -> JudgmentTrace:
    first = rows[0]
    judged = [r for r in rows if r.get("order")]
    winners = {r.get("winner") for r in judged}
    consistent = None if len(judged) < 2 else (len(winners) == 1 and None not in winners)
    statuses = [r["status"] for r in rows]
    status = next((s for s in ("api_error", "parse_error") if s in statuses), "ok")
    trace = JudgmentTrace(
        name=f"{pairing}/{prompt_id}",
        inputs={"prompt": first["prompt"], first["model_a"]: first["completion_a"], first["model_b"]: first["completion_b"]},
        outputs={f"verdict_{r['order']}": r.get("parsed_verdict") for r in judged} or {"verdict": "tie"},
        tags={"pairing": pairing, "prompt_id": prompt_id, "status": status, "identical": str(not judged).lower(),
              "consistent": "n/a" if consistent is None else str(consistent).lower()},
    )
    for r in judged:
        error = r.get("error") or (None if r.get("winner") else f"no verdict ({r['status']})")
        trace.feedback.append({"name": f"verdict_{r['order']}", "value": r.get("winner"),
                               "rationale": r.get("raw_verdict_reask") or r.get("raw_verdict"), "error": error})
    if not judged:
        trace.feedback.append({"name": "verdict", "value": "tie", "rationale": "identical answers: a tie, no judge call",
                               "error": None})
    if consistent is not None:
        trace.feedback.append({"name": "consistent", "value": consistent,
                               "rationale": "both orders picked the same model" if consistent else
                               "the two orders picked different winners", "error": None})
    return trace


def most_telling_first(traces: list[JudgmentTrace], limit: int) -> list[JudgmentTrace]:
    """At most `limit` traces: failed judgments and order disagreements first, so a cap never hides them."""
    def rank(t: JudgmentTrace) -> int:
        return 0 if t.tags["status"] != "ok" else 1 if t.tags["consistent"] == "false" else 2
    return sorted(traces, key=rank)[:limit]


def log_judgment_traces(tracking_uri: str, experiment_id: str, run_id: str, traces: list[JudgmentTrace],
                        judge_id: str) -> list[str]:
    """Logs each trace under `run_id` with its feedback; returns the trace ids."""
    import mlflow
    from mlflow import MlflowClient
    from mlflow.entities import AssessmentError, AssessmentSource

    mlflow.set_tracking_uri(tracking_uri)  # the fluent feedback API and the trace exporter use the global URI
    client = MlflowClient(tracking_uri)
    ids = []
    for t in traces:
        span = client.start_trace(t.name, span_type=TRACE_SPAN_TYPE, inputs=t.inputs, tags=t.tags,
                                  experiment_id=experiment_id, run_id=run_id)
        client.end_trace(span.trace_id, outputs=t.outputs, status="OK" if t.tags["status"] == "ok" else "ERROR")
        ids.append(span.trace_id)
    mlflow.flush_trace_async_logging()  # feedback needs the trace stored first
    source = AssessmentSource(source_type="LLM_JUDGE", source_id=judge_id)
    for trace_id, t in zip(ids, traces, strict=True):
        for fb in t.feedback:
            error = AssessmentError(error_code="JUDGE_ERROR", error_message=fb["error"]) if fb["error"] else None
            mlflow.log_feedback(trace_id=trace_id, name=fb["name"], value=fb["value"] if error is None else None,
                                rationale=fb["rationale"], source=source, error=error)
    return ids
