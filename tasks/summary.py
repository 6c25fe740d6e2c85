"""Task `publish_summary`: one summary of a pipeline run, as a dict, a Prefect markdown artifact and MLflow files.

The dict is what the flows return (a demo prints it); the markdown artifact (key `rlhf-summary`) shows
the stages with their MLflow runs, reward at start and end, KL, every win rate with its CI and
the promotion decision, with a link to the parent MLflow run.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from tasks import tracking
from tasks.checkpoints import CheckpointInfo
from tasks.evaluate import EvalSummary
from tasks.registry import Promotion
from tasks.reward import RewardInfo
from tasks.tracking import RunRef
from tasks.train import TrainResult

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


@task(name="publish_summary", cache_policy=NO_CACHE)
def publish_summary(
    title: str,
    run_dir: str,
    parent: RunRef,
    sft: CheckpointInfo | None = None,
    reward: RewardInfo | None = None,
    trained: TrainResult | None = None,
    evaluation: EvalSummary | None = None,
    promotion: Promotion | None = None,
    error: str | None = None,
) -> dict[str, Any]:
    """Builds the run summary, publishes it (Prefect artifact, MLflow parent run) and returns it."""
    summary = build_summary(run_dir, parent, sft, reward, trained, evaluation, promotion, error)
    markdown = render_markdown(title, summary)
    create_markdown_artifact(
        key="rlhf-summary", markdown=markdown, description=f"{title}: stages, win rates, promotion"
    )
    out = Path(run_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    (out / "summary.md").write_text(markdown)
    tracking.log_artifact(parent, out / "summary.json")
    tracking.log_artifact(parent, out / "summary.md")
    if trained and trained.reward_curve:
        tracking.log_artifact(parent, trained.reward_curve)
    metrics: dict[str, float | None] = {
        f"train/{k}": v
        for k, v in (summary.get("train") or {}).items()
        if isinstance(v, (int, float)) and not isinstance(v, bool)
    }
    for name, r in (summary.get("evaluation") or {}).items():
        metrics.update({f"{name}/{k}": r.get(k) for k in ("win_rate", "ci_low", "ci_high", "lc_win_rate")})
    tracking.log_metrics(parent, metrics)
    # The run's description in the MLflow UI: the result, readable without opening anything.
    tracking.set_tags(parent, {"mlflow.note.content": headline(summary)})
    return summary


def headline(s: dict[str, Any]) -> str:
    """One line: the gate pairing's win rate with its CI, and the promotion decision (or the error)."""
    parts = []
    if s.get("error"):
        parts.append(f"Failed: {s['error']}")
    for name, r in (s.get("evaluation") or {}).items():
        if name == "policy_vs_sft" or len(s["evaluation"]) == 1:
            parts.append(
                f"{name} win rate {_pct(r['win_rate'])} (95% CI [{_pct(r['ci_low'])}, {_pct(r['ci_high'])}], n={r['n']})"
            )
    if p := s.get("promotion"):
        gate = "gate passed" if p["passed"] else "gate failed"
        parts.append(f"{gate}; registered {p['model_uri']} (version {p['version']})" if p["registered"] else gate)
    return "; ".join(parts) or "no results"


def publish_failure_summary(title: str, run_dir: str, parent: RunRef, error: BaseException, **results: Any) -> None:
    """Publishes what finished before `error`; never masks the error with a failure of its own."""
    try:
        publish_summary(title, run_dir, parent, error=f"{type(error).__name__}: {error}", **results)
    except Exception as publish_error:  # the stage's error is the one that matters
        get_run_logger().warning("could not publish the failure summary: %s", publish_error)


def build_summary(
    run_dir: str,
    parent: RunRef,
    sft: CheckpointInfo | None,
    reward: RewardInfo | None,
    trained: TrainResult | None,
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
            lc = "not estimable" if r.get("lc_not_estimable") else _pct(r["lc_win_rate"])
            corrected = (
                f"{_pct(r.get('bias_corrected_win_rate'))} [{_pct(r.get('bias_corrected_ci_low'))}, "
                f"{_pct(r.get('bias_corrected_ci_high'))}]"
            )
            lines.append(
                f"| {name} | {_pct(r['win_rate'])} | [{_pct(r['ci_low'])}, {_pct(r['ci_high'])}] | {lc} | {corrected} "
                f"| {r['n']} | {r['n_parse_error']} | {r['n_api_error']} | {_pct(r['consistency_rate'])} "
                f"| {_pct(r.get('first_slot_rate'))} |"
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


def _pct(x: Any) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"
