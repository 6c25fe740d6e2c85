"""Task `evaluate_win_rate`: run the evaluation library, record every pairing's numbers in MLflow and Prefect.

Per pairing the `evaluate` MLflow run gets `<pairing>/win_rate`, `ci_low`, `ci_high`, `se`, `lc_win_rate`
(+ CI), `n`, `n_valid`, `n_parse_error`, `n_api_error`, `consistency_rate`, `first_slot_rate` and the
mean lengths; the judgments table goes in with `log_table`, so it can be browsed and compared in the UI.
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
from pydantic import BaseModel

from rloo_engine.config import ConfigError
from rloo_engine.evaluation.report import PairingResult
from tasks import tracking
from tasks.config import PipelineConfig
from tasks.secrets import read_secret_block, scoped_env
from tasks.tracking import RunRef

# Every numeric statistic of the library's PairingResult, so one added there is logged here as well.
PAIRING_METRICS = tuple(
    name for name, f in PairingResult.model_fields.items() if f.annotation in (int, float, float | None)
)


class EvalSummary(BaseModel):
    """What the flow and the promotion gate need from an evaluation; the full report stays in results.json."""

    pairings: dict[str, dict[str, float | int | str | None]]
    paired_difference: dict[str, float | int | str | None] | None
    warnings: list[str]
    results_path: str
    judgments_path: str
    mlflow_run_id: str


@task(name="check_evaluation_inputs", cache_policy=NO_CACHE)
def check_evaluation_inputs(cfg: PipelineConfig) -> dict[str, int]:
    """Checks the judge config, eval prompts and reference data before training; ConfigError names the field."""
    from rloo_engine.evaluation.preflight import check_inputs

    with scoped_env(_judge_secret(cfg)):
        try:
            counts = check_inputs(cfg.eval_config(output_dir="<run>/eval"))
        except ConfigError as err:
            message = _pipeline_field_names(str(err))
            raise ConfigError(f"evaluation inputs (checked before training): {message}") from None
    get_run_logger().info("evaluation inputs: %s", ", ".join(f"{k} {v}" for k, v in counts.items()))
    return counts


# EvalConfig field -> the PipelineConfig field it comes from, so errors name what the user wrote.
_PIPELINE_FIELDS = {
    "prompts": "data.eval_prompts",
    "prompt_column": "data.prompt_column",
    "reference_column": "data.reference_column",
    "reference_completions": "data.reference_completions",
    "judge.": "evaluation.judge.",
}


def _pipeline_field_names(message: str) -> str:
    for eval_name, pipeline_name in _PIPELINE_FIELDS.items():
        if message.startswith(eval_name):
            return pipeline_name + message[len(eval_name) :]
    return message


def warning_tags(warnings: list[str]) -> dict[str, str]:
    """{`evaluation.warning.<pairing>.<kind>`: message} for MLflow tags (values cut to MLflow's 5000 characters)."""
    kinds = {
        "position bias": "position_bias",
        "length-controlled win rate not estimable": "lc_not_estimable",
        "length-controlled": "lc_gap",
        "have no verdict": "failed",
        "lack a completion": "missing",
    }
    tags: dict[str, str] = {}
    for warning in warnings:
        pairing, _, text = warning.partition(": ")
        kind = next((k for marker, k in kinds.items() if marker in text), "other")
        tags[f"evaluation.warning.{pairing}.{kind}"] = warning[:5000]
    return tags


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
            run, {f"evaluation.{k}": v for k, v in _flat(cfg.evaluation.model_dump(mode="json")).items()}
        )
        with scoped_env(_judge_secret(cfg)):
            report = run_evaluation(eval_cfg, policy_path=policy_path, sft_path=sft_path, output_dir=out)

        for name, result in report.pairings.items():
            values = result.model_dump()
            tracking.log_metrics(run, {f"{name}/{k}": values.get(k) for k in PAIRING_METRICS})
            logger.info(
                "%s: win rate %s [%s, %s], LC %s, n=%d (parse errors %d, api errors %d)",
                name,
                _pct(result.win_rate),
                _pct(result.ci_low),
                _pct(result.ci_high),
                _pct(result.lc_win_rate),
                result.n,
                result.n_parse_error,
                result.n_api_error,
            )
        diff = report.paired_difference.model_dump() if report.paired_difference else None
        if diff:
            tracking.log_metrics(
                run, {f"paired_difference/{k}": v for k, v in diff.items() if isinstance(v, (int, float))}
            )
        usage = report.usage.model_dump()
        tracking.log_metrics(run, {f"judge/{k}": v for k, v in usage.items() if isinstance(v, (int, float))})

        c = tracking.client(run.tracking_uri)
        c.log_table(run.run_id, data=report.table_columns(), artifact_file="judgments.json")
        tracking.log_artifact(run, report.results_path)
        tracking.log_artifact(run, report.judgments_path)
        for path in report.completions.values():
            tracking.log_artifact(run, path, "completions")
        for warning in report.warnings:
            logger.warning("evaluation: %s", warning)
        tags = warning_tags(report.warnings)
        tags["evaluation.warnings"] = str(len(report.warnings))
        tracking.set_tags(run, tags)
        tracking.set_tags(parent, tags)

        level = f"{eval_cfg.confidence_level:.0%}"
        rows = [_table_row(name, r.model_dump(), level) for name, r in report.pairings.items()]
        create_table_artifact(key="win-rates", table=rows, description=f"Win rates with {level} CIs, per pairing")
        return EvalSummary(
            pairings={
                name: {k: r.model_dump().get(k) for k in (*PAIRING_METRICS, "lc_not_estimable")}
                for name, r in report.pairings.items()
            },
            paired_difference=diff,
            warnings=list(report.warnings),
            results_path=str(report.results_path),
            judgments_path=str(report.judgments_path),
            mlflow_run_id=run.run_id,
        )


def _judge_secret(cfg: PipelineConfig) -> dict[str, str]:
    """{api_key_env: key} from the configured Secret block; {} when the key is expected in the environment."""
    judge = cfg.evaluation.judge
    if not cfg.evaluation.api_key_secret or not judge.api_key_env:
        return {}
    return {judge.api_key_env: read_secret_block(cfg.evaluation.api_key_secret, "evaluation.api_key_secret")}


def _table_row(name: str, r: dict, level: str) -> dict[str, str | int | None]:
    return {
        "pairing": name,
        "win rate": _pct(r["win_rate"]),
        f"{level} CI": f"[{_pct(r['ci_low'])}, {_pct(r['ci_high'])}]",
        "LC win rate": "not estimable" if r.get("lc_not_estimable") else _pct(r["lc_win_rate"]),
        "bias-corrected": _pct(r.get("bias_corrected_win_rate")),
        "n": r["n"],
        "parse errors": r["n_parse_error"],
        "api errors": r["n_api_error"],
        "consistency": _pct(r["consistency_rate"]),
    }


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def _flat(values: dict, prefix: str = "") -> dict:
    out: dict = {}
    for k, v in values.items():
        if isinstance(v, dict) and v:
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out
