"""One summary of a pipeline run: the dict the flows return (a demo prints it), its one-line headline (the MLflow
run's description) and its Markdown (the Prefect artifact `rlhf-summary`): stages with their MLflow runs, reward at
start and end, KL, every win rate with its CI, and the promotion decision."""

from __future__ import annotations

import math
from typing import Any

from rloo_engine.pipeline import tracking
from rloo_engine.pipeline.input_checkpoints import CheckpointInfo
from rloo_engine.pipeline.stage_results import EvalSummary, Promotion, RewardInfo, TrainStageResult
from rloo_engine.pipeline.tracking import RunRef

STAGE_ORDER = ("ingest", "ingest_policy", "reward", "train", "evaluate", "register")
SUMMARY_PAIRING_KEYS = (
    "win_rate",
    "ci_low",
    "ci_high",
    "lc_win_rate",
    "n",
    "n_valid",
    "n_parse_error",
    "n_api_error",
    "consistency_rate",
    "first_slot_rate",
    "bias_corrected_win_rate",
    "bias_corrected_ci_low",
    "bias_corrected_ci_high",
    "lc_not_estimable",
)


def headline(s: dict[str, Any]) -> str:
    """One line: the gate pairing's win rate with its CI, and the promotion decision (or the error)."""
    parts = []
    if s.get("error"):
        parts.append(f"Failed: {s['error']}")
    for name, r in (s.get("evaluation") or {}).items():
        if name == "policy_vs_sft" or len(s["evaluation"]) == 1:
            parts.append(
                f"{name} win rate {pct(r['win_rate'])} (95% CI [{pct(r['ci_low'])}, {pct(r['ci_high'])}], n={r['n']})"
            )
    if p := s.get("promotion"):
        gate = "gate passed" if p["passed"] else "gate failed"
        parts.append(f"{gate}; registered {p['model_uri']} (version {p['version']})" if p["registered"] else gate)
    return "; ".join(parts) or "no results"


def build_summary(
    run_dir: str,
    parent: RunRef,
    sft: CheckpointInfo | None,
    reward: RewardInfo | None,
    trained: TrainStageResult | None,
    evaluation: EvalSummary | None,
    promotion: Promotion | None,
    error: str | None,
) -> dict[str, Any]:
    summary: dict[str, Any] = {
        "output_dir": run_dir,
        "mlflow": {
            "tracking_uri": parent.tracking_uri,
            "experiment_id": parent.experiment_id,
            "run_id": parent.run_id,
            "run_url": parent.url,
        },
        "stages": stage_runs(parent),
        "error": error,
    }
    if sft:
        summary["sft"] = {
            "source": sft.source,
            "digest": sft.digest,
            "architecture": sft.facts.architecture,
            "num_parameters": sft.facts.num_parameters,
        }
    if reward:
        summary["reward"] = {
            "model": reward.model.source if reward.model else None,
            "functions": reward.functions,
            "probe": {k: v.model_dump() for k, v in reward.probe.items()},
        }
    if trained:
        m = trained.metrics
        summary["train"] = {
            "final_checkpoint": trained.final_dir,
            "global_step": trained.global_step,
            "attempts": trained.attempts,
            "reward_start": m.get("reward_start"),
            "reward_end": m.get("reward_end"),
            "reward_first_quarter": m.get("reward_first_quarter"),
            "reward_last_quarter": m.get("reward_last_quarter"),
            "kl_end": m.get("kl_end"),
            "mean_length_end": m.get("mean_length_end"),
            "reward_curve": trained.reward_curve,
        }
    if evaluation:
        summary["evaluation"] = {
            name: {k: r.get(k) for k in SUMMARY_PAIRING_KEYS} for name, r in evaluation.pairings.items()
        }
        summary["evaluation_warnings"] = evaluation.warnings
    if promotion:
        summary["promotion"] = {
            "passed": promotion.decision.passed,
            "reason": promotion.decision.reason,
            "registered": promotion.registered,
            "model_name": promotion.model_name,
            "alias": promotion.alias,
            "version": promotion.version,
            "model_uri": promotion.model_uri,
        }
    return summary


def stage_runs(parent: RunRef) -> dict[str, dict[str, Any]]:
    """Each stage's child run: status, duration and link, in pipeline order."""
    c = tracking.client(parent.tracking_uri)
    runs = c.search_runs([parent.experiment_id], filter_string=f"tags.`{tracking.TAG_PARENT}` = '{parent.run_id}'")
    stages = {}
    for run in runs:
        stage = run.data.tags.get(tracking.TAG_STAGE, run.info.run_name)
        stages[stage] = {
            "status": run.info.status,
            "run_id": run.info.run_id,
            "duration_s": run.data.metrics.get("duration_s"),
            "url": tracking.run_url(parent.tracking_uri, parent.experiment_id, run.info.run_id),
        }
    order = {name: i for i, name in enumerate(STAGE_ORDER)}
    return dict(sorted(stages.items(), key=lambda kv: order.get(kv[0], len(order))))


def render_markdown(title: str, s: dict[str, Any]) -> str:
    mlflow_link = s["mlflow"]["run_url"] or f"run `{s['mlflow']['run_id']}` at `{s['mlflow']['tracking_uri']}`"
    lines = [f"# {title}", ""]
    if s.get("error"):
        lines += [f"**Failed:** {s['error']}", ""]
    # A list, not consecutive lines: Markdown joins consecutive lines into one paragraph.
    if s.get("evaluation"):
        lines += [f"**{headline(s)}**", ""]
    lines += [
        f"- MLflow parent run: {mlflow_link}",
        f"- output directory: `{s['output_dir']}`",
        "",
        "## Stages",
        "",
        "| stage | status | duration | MLflow run |",
        "|---|---|---|---|",
    ]
    for name, st in s["stages"].items():
        link = f"[{st['run_id'][:8]}]({st['url']})" if st["url"] else st["run_id"][:8]
        lines.append(f"| {name} | {st['status']} | {_num(st['duration_s'], '{:.0f} s')} | {link} |")
    if train := s.get("train"):
        lines += [
            "",
            "## Training",
            "",
            f"- steps: {train['global_step']} (attempts: {train['attempts']})",
            f"- reward: {_num(train['reward_start'])} → {_num(train['reward_end'])} "
            f"(first quarter {_num(train['reward_first_quarter'])}, last quarter {_num(train['reward_last_quarter'])})",
            f"- KL at the end: {_num(train['kl_end'])}",
            f"- final checkpoint: `{train['final_checkpoint']}`",
        ]
    if evaluation := s.get("evaluation"):
        lines += [
            "",
            "## Win rates",
            "",
            "| pairing | win rate | CI | LC win rate | bias-corrected | n | parse errors | api errors | consistency "
            "| first slot |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for name, r in evaluation.items():
            lc = "not estimable" if r.get("lc_not_estimable") else pct(r["lc_win_rate"])
            corrected = (
                f"{pct(r.get('bias_corrected_win_rate'))} [{pct(r.get('bias_corrected_ci_low'))}, "
                f"{pct(r.get('bias_corrected_ci_high'))}]"
            )
            lines.append(
                f"| {name} | {pct(r['win_rate'])} | [{pct(r['ci_low'])}, {pct(r['ci_high'])}] | {lc} | {corrected} "
                f"| {r['n']} | {r['n_parse_error']} | {r['n_api_error']} | {pct(r['consistency_rate'])} "
                f"| {pct(r.get('first_slot_rate'))} |"
            )
        if warnings := s.get("evaluation_warnings"):
            # The numbers above can mislead without these (position bias, LC outside the data, failures).
            lines += ["", "### Evaluation warnings", ""] + [f"- {w}" for w in warnings]
    if promotion := s.get("promotion"):
        verdict = (
            f"registered `{promotion['model_uri']}` (version {promotion['version']})"
            if promotion["registered"]
            else "not registered"
        )
        lines += [
            "",
            "## Promotion",
            "",
            f"- gate {'passed' if promotion['passed'] else 'failed'}: {promotion['reason']}",
            f"- {verdict}",
        ]
    return "\n".join(lines) + "\n"


def _num(x: Any, fmt: str = "{:.4f}") -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else fmt.format(x)


def pct(x: Any) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"
