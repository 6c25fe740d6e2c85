"""The evaluation's outputs: `EvalReport` (written as `results.json`) and the per-judgment table (`judgments.jsonl`).

The table has one row per judge verdict (two per prompt in both-order mode, one for a prompt whose
answers are identical and so were tied without a call), with the columns listed in
`TABLE_COLUMNS`. `EvalReport.table_columns()` returns it as a dict of columns, the shape
`mlflow.log_table(data=..., artifact_file=...)` takes; `EvalReport.dataframe()` as pandas.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

TABLE_COLUMNS = (
    "pairing",  # policy_vs_reference, sft_vs_reference or policy_vs_sft
    "prompt_id",  # stable hash of the prompt
    "prompt",
    "model_a",  # first model of the pairing (its wins count for the win rate)
    "model_b",
    "completion_a",  # model_a's completion
    "completion_b",
    "order",  # "ab": model_a's completion shown in slot A; "ba": swapped; null: identical, no call
    "status",  # ok, parse_error or api_error
    "raw_verdict",  # the judge's reply, as returned
    "raw_verdict_reask",  # its reply to the re-ask, when the first did not parse
    "parsed_verdict",  # slot verdict: A, B, tie, or null (with judge.verdict logprobs: the argmax of the soft one)
    "soft_preference",  # judge.verdict logprobs: P(model_a's slot) = P(A)/(P(A)+P(B)), 1 minus it in order "ba"; null else
    "winner",  # model_a's or model_b's name, tie, or null when the judgment failed
    "prompt_tokens",
    "completion_tokens",
    "cached",  # true when the judgment came from the cache, not a call in this run
    "template_hash",
    "served_model",  # the model id the endpoint reported (e.g. gpt-4o-2024-08-06 for gpt-4o); null if none
    "error",
    "cache_key",
)


class PairingResult(BaseModel):
    """One comparison, model_a against model_b; rates are model_a's."""

    name: str
    model_a: str
    model_b: str
    n: int = Field(description="Prompts with completions from both models: n_valid + n_parse_error + n_api_error.")
    n_valid: int = Field(description="Prompts with a usable verdict (ties of identical answers included).")
    n_win: int = Field(description="Counted wins: prompts, or single orders in `average` mode (a count, not the "
                                   "rate's unit: the rate weighs every prompt once).")
    n_loss: int
    n_tie: int
    n_parse_error: int = Field(
        description="Prompts whose verdict did not parse after a re-ask; excluded from the rate."
    )
    n_api_error: int = Field(description="Prompts whose judge call failed after its retries; excluded from the rate.")
    n_identical: int = Field(description="Prompts where both completions are identical: a tie, judged without a call.")
    n_missing: int = Field(description="Eval prompts lacking a completion from one of the two models.")
    win_rate: float | None = Field(
        description="Mean per-prompt score over valid prompts (win 1, tie 0.5, loss 0; `average` mode averages a "
        "prompt's two orders). Equals (W + 0.5 T) / (W + L + T) except in `average` mode with identical answers."
    )
    se: float | None = Field(description="Standard error of the win rate (per-prompt scores, ddof=1).")
    ci_low: float | None = Field(description="Clopper-Pearson interval of the win rate on per-prompt scores, from 50 "
                                  "prompts on with an effective sample size that ties raise.")
    ci_high: float | None
    lc_win_rate: float | None = Field(
        description="Length-controlled win rate: fitted rate at equal length. None when not estimable."
    )
    lc_ci_low: float | None
    lc_ci_high: float | None
    lc_not_estimable: str | None = Field(
        None, description="Why LC is None although there are valid prompts (equal length outside the data, or no fit)."
    )
    sc_win_rate: float | None = Field(
        None, description="Style-controlled win rate (after Arena-Hard's style control): the fitted rate at equal "
        "length and equal markdown (headers, list items, bold). Equals LC where no answer uses markdown."
    )
    sc_ci_low: float | None = None
    sc_ci_high: float | None = None
    sc_not_estimable: str | None = Field(None, description="Why the style-controlled rate is None.")
    sc_features: list[str] = Field(
        default_factory=list, description="What the style-controlled rate holds equal: length and the markdown "
        "elements any answer uses."
    )
    consistency_rate: float | None = Field(
        description="Share of judged prompts whose two orders pick the same winner (both-order mode only)."
    )
    first_slot_rate: float | None = Field(
        description="Share of verdicts that picked slot A, a tie counting half (0.5 = no position bias)."
    )
    n_slot_verdicts: int = Field(0, description="Verdicts (A, B or tie) behind first_slot_rate.")
    slot_bias: float | None = Field(
        None, description="Estimated share of verdicts decided by slot, not content: |2 first_slot_rate - 1| with "
        "its sampling noise taken out (sqrt(max(0, (2f - 1)^2 - Var))), so an unbiased judge's is near 0."
    )
    slot_bias_ci_low: float | None = Field(
        None, description="Normal interval of the slot bias from the prompt-clustered variance of the first-slot rate; "
        "the position-bias warning fires only when its lower bound is above 0."
    )
    slot_bias_ci_high: float | None = None
    bias_corrected_win_rate: float | None = Field(
        None, description="The win rate with the estimated slot bias undone: 0.5 + (win_rate - 0.5) / (1 - slot_bias)."
    )
    bias_corrected_ci_low: float | None = Field(
        None, description="Bonferroni interval: the correction at the corners of intervals of the raw rate and of beta."
    )
    bias_corrected_ci_high: float | None = None
    rate_by_length_difference: list[dict[str, Any]] = Field(
        default_factory=list,
        description="The raw rate in three equal-count strata of the length difference (a minus b), each with "
        "delta_min, delta_max, n, win_rate and an exact interval. Shown also when LC is not estimable.",
    )
    mean_length_a: float | None
    mean_length_b: float | None
    length_unit: str


class PairedDifference(BaseModel):
    """Policy minus SFT, each judged against the same references, on the prompts valid in both."""

    first: str = "policy_vs_reference"
    second: str = "sft_vs_reference"
    n: int
    difference: float | None = Field(description="Mean per-prompt score difference (policy's rate minus SFT's).")
    se: float | None
    ci_low: float | None
    ci_high: float | None
    n_first_better: int
    n_second_better: int
    n_same: int
    p_value: float = Field(description="Exact two-sided sign test on discordant prompts (McNemar's exact test).")


class Usage(BaseModel):
    """Judge calls and tokens. "This run" counts exclude judgments taken from the cache."""

    requests: int = Field(description="HTTP requests sent in this run, retries and re-asks included.")
    judgments_made: int = Field(description="Judgments made in this run.")
    judgments_cached: int = Field(description="Judgments read from the cache.")
    judgments_without_call: int = Field(description="Identical-answer ties, decided without the judge.")
    prompt_tokens: int
    completion_tokens: int
    cost_usd: float | None = Field(
        description="Cost of this run (Batch API tokens at batch prices); None when the judge model has no price."
    )
    batch_prompt_tokens: int = Field(0, description="Of prompt_tokens, those sent through the Batch API.")
    batch_completion_tokens: int = Field(0, description="Of completion_tokens, those returned by the Batch API.")
    total_prompt_tokens: int = Field(description="Tokens of every judgment in this report, cached ones included.")
    total_completion_tokens: int
    total_cost_usd: float | None
    budget_usd: float | None


class EvalReport(BaseModel):
    """What `run_evaluation` returns, and what `results.json` holds."""

    pairings: dict[str, PairingResult]
    paired_difference: PairedDifference | None
    usage: Usage
    judge: dict[str, Any] = Field(description="Backend, model, template (name, version, hash) and order settings.")
    warnings: list[str]
    timings: dict[str, float] = Field(description="Seconds spent generating, judging and in total.")
    completions: dict[str, str] = Field(description="Completions JSONL of each side (policy, sft, reference).")
    results_path: Path
    judgments_path: Path
    cache_path: Path
    config: dict[str, Any]

    def table(self) -> list[dict[str, Any]]:
        """Rows of `judgments.jsonl`, one dict per judgment."""
        with self.judgments_path.open(encoding="utf-8") as f:
            return [json.loads(line) for line in f if line.strip()]

    def table_columns(self) -> dict[str, list[Any]]:
        """The table as {column: values}, ready for `mlflow.log_table(data=..., artifact_file="judgments.json")`."""
        rows = self.table()
        return {column: [row[column] for row in rows] for column in TABLE_COLUMNS}

    def dataframe(self) -> Any:
        """The table as a pandas DataFrame (needs pandas)."""
        import pandas as pd

        return pd.DataFrame(self.table(), columns=list(TABLE_COLUMNS))

    @classmethod
    def load(cls, results_path: str | Path) -> EvalReport:
        return cls.model_validate_json(Path(results_path).read_text(encoding="utf-8"))


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def write_table(path: Path, rows: list[dict[str, Any]]) -> None:
    _atomic_write(
        path, "".join(json.dumps({c: row.get(c) for c in TABLE_COLUMNS}, ensure_ascii=False) + "\n" for row in rows)
    )


def write_report(report: EvalReport) -> None:
    _atomic_write(report.results_path, report.model_dump_json(indent=2) + "\n")


def format_summary(report: EvalReport) -> str:
    """A few human-readable lines: each pairing's rate with its CI and failure counts, then cost."""

    def pct(x: float | None) -> str:
        return "  n/a" if x is None else f"{100 * x:5.1f}"

    def rate(x: float | None) -> str:
        """A percentage with its sign, or `n/a` alone (never `n/a%`)."""
        return "   n/a" if x is None else f"{pct(x)}%"

    lines = []
    for r in report.pairings.values():
        lc = "   n/e" if r.lc_not_estimable else rate(r.lc_win_rate)  # n/e: not estimable, see the warnings
        lines.append(
            f"{r.name:<20} win {rate(r.win_rate)} [{pct(r.ci_low)}, {pct(r.ci_high)}]  LC {lc}  "
            f"bias-corrected {rate(r.bias_corrected_win_rate)} [{pct(r.bias_corrected_ci_low)}, "
            f"{pct(r.bias_corrected_ci_high)}]  W/L/T {r.n_win}/{r.n_loss}/{r.n_tie}  n={r.n} valid={r.n_valid} "
            f"parse_err={r.n_parse_error} api_err={r.n_api_error}  consistency {rate(r.consistency_rate)}  "
            f"first-slot {rate(r.first_slot_rate)}"
        )
    d = report.paired_difference
    if d is not None and d.difference is not None:
        lines.append(
            f"{'policy - sft':<20} diff {100 * d.difference:+5.1f} pts [{pct(d.ci_low)}, {pct(d.ci_high)}]  "
            f"p={d.p_value:.3g} (sign test, n={d.n})"
        )
    u = report.usage
    cost = "unknown" if u.cost_usd is None else f"${u.cost_usd:.4f}"
    lines.append(
        f"judge: {u.judgments_made} judged, {u.judgments_cached} cached, {u.requests} requests, "
        f"{u.prompt_tokens}+{u.completion_tokens} tokens, cost {cost}"
    )
    lines.extend(f"warning: {w}" for w in report.warnings)
    lines.append(f"results: {report.results_path}")
    return "\n".join(lines)
