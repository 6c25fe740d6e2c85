"""Each judged prompt as an MLflow trace with assessments, the way MLflow 3 shows GenAI evaluations.

The judgments table (`judgments.json`) holds every verdict, but the MLflow UI shows a table artifact as
rows to scroll. As traces, each judged prompt is one entry of the evaluate run's Traces tab: the
prompt and both answers as inputs, the per-order verdicts as outputs, and its feedback (assessments):

- `<model_a>_wins_vs_<model_b>` (e.g. `policy_wins_vs_sft`): the prompt's score for model_a, 1 / 0.5 / 0,
  by the evaluation's own rule (`pairings.combine_orders`, so `both_orders_rule` applies). The run's
  Traces tab averages a numeric feedback over the traces in its assessment summary, which so reads as
  each pairing's win rate. A failed prompt's score is an error, not a value: it is out of the rate too.
- `verdict_<order>` per judged order: the winning model, with the judge's own reply as rationale.
- `consistent` when both orders were judged.

Sources say who decided: the verdicts are the judge's (`LLM_JUDGE` for a language-model judge, `CODE`
for a python rule or a reward model); the score and `consistent` are `CODE` from `COMPUTED_BY`.
Tags (`pairing`, `status`, `consistent`, `identical`) make the disagreements one filter away:
`tags.consistent = 'false'`. Above the `trace_judgments` cap the traces are a seeded uniform random
sample, logged in random order (`sample_traces`), so the UI's averages estimate the full set's; every
judgment, failures and disagreements included, stays in the judgments table.
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from rloo_engine.evaluation.judges.base import Judgment
from rloo_engine.evaluation.pairings import ItemOutcome, PairItem, combine_orders

TRACE_SPAN_TYPE = "EVALUATOR"
COMPUTED_BY = "rloo_engine.evaluation.pairings.combine_orders"  # source id of the feedback our code derives
# Judge backends that are language models (chat completions; a local chat model's label probabilities).
# The others, python rules and reward models, are code, and MLflow should say so.
LLM_JUDGE_BACKENDS = ("openai", "hf")


@dataclass(frozen=True)
class Feedback:
    """One assessment of a trace: a value with its rationale, or an error where there is no value."""

    name: str
    value: float | str | bool | None
    rationale: str | None
    error: str | None = None
    computed: bool = False  # derived by COMPUTED_BY; otherwise it is the judge's own verdict


@dataclass
class JudgmentTrace:
    """What one judged prompt of one pairing becomes: a trace and its feedback."""

    name: str
    inputs: dict[str, Any]
    outputs: dict[str, Any]
    tags: dict[str, str]
    feedback: list[Feedback] = field(default_factory=list)


def score_name(model_a: str, model_b: str) -> str:
    """The per-prompt score's feedback name, e.g. `policy_wins_vs_sft`: its mean is model_a's win rate."""
    return f"{model_a}_wins_vs_{model_b}"


def judge_source_type(backend: str) -> str:
    """MLflow's source type of the judge's verdicts: `LLM_JUDGE` for a language model, else `CODE`."""
    return "LLM_JUDGE" if backend in LLM_JUDGE_BACKENDS else "CODE"


def judgment_traces(rows: Iterable[dict[str, Any]], both_orders_rule: str) -> list[JudgmentTrace]:
    """Groups judgments-table rows (one per order) into one JudgmentTrace per (pairing, prompt)."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row["pairing"], row["prompt_id"]), []).append(row)
    return [_trace(group, both_orders_rule) for group in groups.values()]


def prompt_outcome(rows: list[dict[str, Any]], both_orders_rule: str) -> ItemOutcome:
    """The prompt's outcome, recomputed from its table rows by the rule that computed the win rate."""
    first = rows[0]
    judged = [r for r in rows if r["order"]]
    item = PairItem(first["pairing"], first["prompt_id"], first["prompt"], first["completion_a"],
                    first["completion_b"], tuple(r["order"] for r in judged))
    judgments = {r["order"]: Judgment(r["status"], r["parsed_verdict"], slot_a_probability=_slot_a_probability(r))
                 for r in judged}
    return combine_orders(item, judgments, both_orders_rule)


def _slot_a_probability(row: dict[str, Any]) -> float | None:
    """A logprobs verdict's P(slot A), from the row's `soft_preference` (model_a's side); None for hard verdicts."""
    soft = row.get("soft_preference")
    return None if soft is None else (soft if row["order"] == "ab" else 1.0 - soft)


def _trace(rows: list[dict[str, Any]], both_orders_rule: str) -> JudgmentTrace:
    first = rows[0]
    judged = [r for r in rows if r["order"]]
    outcome = prompt_outcome(rows, both_orders_rule)
    consistent = outcome.consistent
    answers = {first["model_a"]: first["completion_a"], first["model_b"]: first["completion_b"]}
    trace = JudgmentTrace(
        name=f"{first['pairing']}/{first['prompt_id']}",
        inputs={"prompt": first["prompt"], **answers},
        outputs={f"verdict_{r['order']}": r.get("parsed_verdict") for r in judged} or {"verdict": "tie"},
        tags={"pairing": first["pairing"], "prompt_id": first["prompt_id"], "status": outcome.status,
              "identical": str(outcome.identical).lower(),
              "consistent": "n/a" if consistent is None else str(consistent).lower()},
    )
    trace.feedback = [_verdict(r) for r in judged]
    trace.feedback.append(_score(first, judged, outcome, both_orders_rule))
    if consistent is not None:
        trace.feedback.append(Feedback("consistent", consistent, "both orders picked the same model" if consistent
                                       else "the two orders picked different winners", computed=True))
    return trace


def _verdict(row: dict[str, Any]) -> Feedback:
    error = row.get("error") or (None if row.get("winner") else f"no verdict ({row['status']})")
    reply = row.get("raw_verdict_reask") or row.get("raw_verdict")
    return Feedback(f"verdict_{row['order']}", row.get("winner"), reply, error)


def _score(first: dict[str, Any], judged: list[dict[str, Any]], outcome: ItemOutcome, rule: str) -> Feedback:
    name = score_name(first["model_a"], first["model_b"])
    if outcome.status != "ok":
        failed = ", ".join(f"{r['order']}: {r['status']}" for r in judged if r["status"] != "ok")
        return Feedback(name, None, None, f"no score ({failed}); left out of the win rate", computed=True)
    if outcome.identical:
        return Feedback(name, outcome.score, "identical answers: a tie, no judge call", computed=True)
    picks = ", ".join(f"{r['order']}: {r['winner']}" for r in judged)
    how = f"both_orders_rule {rule}" if len(judged) == 2 else "one order judged"
    return Feedback(name, outcome.score, f"{picks} ({how})", computed=True)


def sample_traces(traces: list[JudgmentTrace], limit: int, seed: int) -> list[JudgmentTrace]:
    """The traces to log, in a seeded random order: all of them, or above `limit` a uniform random sample
    with each pairing's share in proportion to its prompts.

    Any other pick (failures first, say) would bias what the UI averages; uniform sampling keeps each
    pairing's mean score an unbiased estimate of its win rate, with the usual sampling error. The order
    matters too: the Traces tab loads the newest 100 traces and summarizes those, so logged pairing by
    pairing its first page would hold one pairing only; in random order any page is a uniform sample.
    """
    rng = random.Random(seed)
    if len(traces) <= limit:
        chosen = list(traces)
    else:
        by_pairing: dict[str, list[JudgmentTrace]] = {}
        for trace in traces:
            by_pairing.setdefault(trace.tags["pairing"], []).append(trace)
        quotas = proportional_quotas({p: len(group) for p, group in by_pairing.items()}, limit)
        chosen = [t for pairing in sorted(by_pairing) for t in rng.sample(by_pairing[pairing], quotas[pairing])]
    rng.shuffle(chosen)
    return chosen


def proportional_quotas(sizes: dict[str, int], total: int) -> dict[str, int]:
    """`total` split over strata in proportion to their sizes, largest remainders rounded up (sums to `total`)."""
    population = sum(sizes.values())
    exact = {k: total * size / population for k, size in sizes.items()}
    quotas = {k: int(share) for k, share in exact.items()}
    short = total - sum(quotas.values())
    for k in sorted(exact, key=lambda k: exact[k] - quotas[k], reverse=True)[:short]:
        quotas[k] += 1
    return quotas


def sample_tags(logged: int, total: int, seed: int) -> dict[str, str]:
    """The evaluate run's tags saying how many judged prompts are traces, of how many, and how they were picked."""
    rule = "every judged prompt" if logged == total else (
        f"a uniform random sample of {logged} of {total} judged prompts, each pairing in proportion to its prompts, "
        f"seed {seed}; every judgment is in the judgments.json table"
    )
    return {"evaluation.judgment_traces": str(logged), "evaluation.judgment_traces.total": str(total),
            "evaluation.judgment_traces.sample": rule}


def log_judgment_traces(tracking_uri: str, experiment_id: str, run_id: str, traces: list[JudgmentTrace],
                        judge_backend: str, judge_id: str) -> list[str]:
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
    judge = AssessmentSource(source_type=judge_source_type(judge_backend), source_id=judge_id)
    code = AssessmentSource(source_type="CODE", source_id=COMPUTED_BY)
    for trace_id, t in zip(ids, traces, strict=True):
        for fb in t.feedback:
            error = AssessmentError(error_code="JUDGE_ERROR", error_message=fb.error) if fb.error else None
            mlflow.log_feedback(trace_id=trace_id, name=fb.name, value=fb.value if error is None else None,
                                rationale=fb.rationale, source=code if fb.computed else judge, error=error)
    return ids
