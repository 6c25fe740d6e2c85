"""Task `evaluate_win_rate`: run the evaluation library, record every pairing's numbers in MLflow and Prefect.

Per pairing the `evaluate` MLflow run gets `<pairing>/win_rate`, `ci_low`, `ci_high`, `se`, `lc_win_rate`
(+ CI), `n`, `n_valid`, `n_parse_error`, `n_api_error`, `consistency_rate`, `first_slot_rate` and the
mean lengths; the judgments table goes in with `log_table`, so it can be browsed and compared in the UI.
The judged prompts become traces of the same run (all of them, or a seeded uniform sample of
`trace_judgments`), each with a `<model_a>_wins_vs_<model_b>` score whose mean is that pairing's win rate.
Each warning (position bias, LC not estimable, failures) becomes an MLflow tag `evaluation.warning.<pairing>.<kind>`
on the evaluate run and the parent run, so runs with untrustworthy numbers can be filtered in the UI.

Task `check_evaluation_inputs` runs first in the pipeline: the judge (template, key, rule), eval prompts and
references are checked before any training, so a typo fails in seconds rather than after RLOO.
The judge's API key is read at run time (Prefect Secret block or environment) and is visible to this
evaluation only while it runs.
"""

from __future__ import annotations

from pathlib import Path

from prefect import get_run_logger, task
from prefect.artifacts import create_table_artifact
from prefect.cache_policies import NO_CACHE

from rloo_engine.config_base import ConfigError
from rloo_engine.evaluation.report import EvalReport
from rloo_engine.pipeline import tracking
from rloo_engine.pipeline.config import EvaluationSection, PipelineConfig, pipeline_field_names
from rloo_engine.pipeline.judgment_traces import judgment_traces, log_judgment_traces, sample_tags, sample_traces
from rloo_engine.pipeline.run_summary import pct
from rloo_engine.pipeline.stage_results import PAIRING_METRICS, EvalSummary, pairing_summary
from rloo_engine.pipeline.tracking import RunRef
from rloo_engine.services import scoped_env
from tasks.secrets import read_secret_block


@task(name="check_evaluation_inputs", cache_policy=NO_CACHE)
def check_evaluation_inputs(cfg: PipelineConfig) -> dict[str, int]:
    """Checks the judge config, eval prompts and reference data before training; ConfigError names the field."""
    from rloo_engine.evaluation.preflight import check_inputs

    with scoped_env(_judge_secret(cfg)):
        try:
            counts = check_inputs(cfg.eval_config(output_dir="<run>/eval"))
        except ConfigError as err:
            message = pipeline_field_names(str(err))
            raise ConfigError(f"evaluation inputs (checked before training): {message}") from None
    get_run_logger().info("evaluation inputs: %s", ", ".join(f"{k} {v}" for k, v in counts.items()))
    return counts


@task(name="evaluate_win_rate", cache_policy=NO_CACHE)
def evaluate_win_rate(
    cfg: PipelineConfig, policy_path: str, sft_path: str | None, run_dir: str, parent: RunRef
) -> EvalSummary:
    """Judges policy vs references, SFT vs references and policy vs SFT; logs rates with CIs."""
    from rloo_engine.evaluation import run_evaluation

    logger = get_run_logger()
    out = Path(run_dir) / "eval"
    with tracking.stage_run(parent, "evaluate") as run:
        eval_cfg = cfg.eval_config(output_dir=str(out))
        tracking.log_params(
            run, tracking.flat_params(cfg.evaluation.model_dump(mode="json"), prefix="evaluation.")
        )
        with scoped_env(_judge_secret(cfg)):
            report = run_evaluation(eval_cfg, policy_path=policy_path, sft_path=sft_path, output_dir=out)

        record_report(run, cfg.evaluation, report)
        for name, result in report.pairings.items():
            logger.info(
                "%s: win rate %s [%s, %s], LC %s, n=%d (parse errors %d, api errors %d)",
                name,
                pct(result.win_rate),
                pct(result.ci_low),
                pct(result.ci_high),
                pct(result.lc_win_rate),
                result.n,
                result.n_parse_error,
                result.n_api_error,
            )
        for warning in report.warnings:
            logger.warning("evaluation: %s", warning)
        tags = tracking.warning_tags(report.warnings)
        tags["evaluation.warnings"] = str(len(report.warnings))
        tracking.set_tags(run, tags)
        tracking.set_tags(parent, tags)

        level = f"{eval_cfg.confidence_level:.0%}"
        rows = [_table_row(name, r.model_dump(), level) for name, r in report.pairings.items()]
        create_table_artifact(key="win-rates", table=rows, description=f"Win rates with {level} CIs, per pairing")
        return EvalSummary(
            pairings={
                name: pairing_summary(r) for name, r in report.pairings.items()
            },
            paired_difference=report.paired_difference.model_dump() if report.paired_difference else None,
            warnings=list(report.warnings),
            results_path=str(report.results_path),
            judgments_path=str(report.judgments_path),
            mlflow_run_id=run.run_id,
        )


def record_report(run: RunRef, evaluation: EvaluationSection, report: EvalReport) -> None:
    """Logs the report on the evaluate run: each pairing's metrics, the judgments table and its traces, the files."""
    for name, result in report.pairings.items():
        values = result.model_dump()
        tracking.log_metrics(run, {f"{name}/{k}": values.get(k) for k in PAIRING_METRICS})
    if report.paired_difference:
        diff = report.paired_difference.model_dump()
        tracking.log_metrics(run, {f"paired_difference/{k}": v for k, v in diff.items() if isinstance(v, (int, float))})
    usage = report.usage.model_dump()
    tracking.log_metrics(run, {f"judge/{k}": v for k, v in usage.items() if isinstance(v, (int, float))})
    tracking.client(run.tracking_uri).log_table(run.run_id, data=report.table_columns(), artifact_file="judgments.json")
    if evaluation.trace_judgments:
        tracking.set_tags(run, record_judgment_traces(run, report.table(), evaluation))
    tracking.log_artifact(run, report.results_path)
    tracking.log_artifact(run, report.judgments_path)
    for path in report.completions.values():
        tracking.log_artifact(run, path, "completions")


def record_judgment_traces(run: RunRef, rows: list[dict], evaluation: EvaluationSection) -> dict[str, str]:
    """Logs the judged prompts as traces of `run` (a seeded sample above `trace_judgments`); returns the run's tags."""
    traces = judgment_traces(rows, evaluation.both_orders_rule)
    logged = sample_traces(traces, evaluation.trace_judgments, evaluation.seed)
    judge = evaluation.judge
    log_judgment_traces(run.tracking_uri, run.experiment_id, run.run_id, logged, judge_backend=judge.backend,
                        judge_id=judge.model or judge.function or judge.backend)
    return sample_tags(len(logged), len(traces), evaluation.seed)


def _judge_secret(cfg: PipelineConfig) -> dict[str, str]:
    """{api_key_env: key} from the configured Secret block; {} when the key is expected in the environment."""
    judge = cfg.evaluation.judge
    if not cfg.evaluation.api_key_secret or not judge.api_key_env:
        return {}
    return {judge.api_key_env: read_secret_block(cfg.evaluation.api_key_secret, "evaluation.api_key_secret")}


def _table_row(name: str, r: dict, level: str) -> dict[str, str | int | None]:
    return {
        "pairing": name,
        "win rate": pct(r["win_rate"]),
        f"{level} CI": f"[{pct(r['ci_low'])}, {pct(r['ci_high'])}]",
        "LC win rate": "not estimable" if r.get("lc_not_estimable") else pct(r["lc_win_rate"]),
        "bias-corrected": pct(r.get("bias_corrected_win_rate")),
        "n": r["n"],
        "parse errors": r["n_parse_error"],
        "api errors": r["n_api_error"],
        "consistency": pct(r["consistency_rate"]),
    }
