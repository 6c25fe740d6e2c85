"""Flow `evaluate-policy`: judge any checkpoint or registered model against the SFT model and the references.

    python -m flows.evaluate_policy --config configs/pipeline_example.yaml --policy models:/rloo-policy@candidate
    prefect deployment run 'evaluate-policy/on-demand' --param policy=models:/rloo-policy/3

Uses the same PipelineConfig as `rlhf-pipeline` (its `sft`, `data`, `evaluation` and `tracking` sections).
"""

from __future__ import annotations

import sys
from typing import Any

from prefect import flow

from rloo_engine.pipeline.config import PipelineConfig
from rloo_engine.pipeline.tracking import end_runs_of_crashed_flow_run, run_status
from tasks.datasets import log_stage_input, record_prompt_sets
from tasks.evaluate import evaluate_win_rate
from tasks.ingest import ingest_policy_checkpoint, ingest_sft_checkpoint
from tasks.run_setup import open_pipeline_run
from tasks.summary import publish_failure_summary, publish_summary

TITLE = "Policy evaluation"


@flow(name="evaluate-policy", log_prints=True, on_crashed=[end_runs_of_crashed_flow_run])
def evaluate_policy(
    cfg: PipelineConfig, policy: str | None = None, overrides: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Win rates of `policy` vs references, SFT vs references and `policy` vs SFT, with CIs.

    Args:
        cfg: the pipeline configuration; `sft` is the baseline the policy is compared with.
        policy: a checkpoint dir, hub id or MLflow model URI. None = the registry's promoted model,
            `models:/<tracking.registered_model>@<tracking.promotion.alias>`.
        overrides: dotted-key changes applied to `cfg`.
    """
    cfg = cfg.with_overrides(overrides)
    policy = policy or f"models:/{cfg.tracking.registered_model}@{cfg.tracking.promotion.alias}"
    run = open_pipeline_run(cfg, "evaluate-policy")
    sft = evaluation = None
    with run_status(run.parent):
        try:
            prompts = record_prompt_sets(cfg.data, run.parent, with_training=False)
            sft = ingest_sft_checkpoint(cfg.sft, run.dir, run.parent)
            candidate = ingest_policy_checkpoint(policy, run.dir, run.parent)
            evaluation = evaluate_win_rate(cfg, candidate.local_path, sft.local_path, run.dir, run.parent)
            log_stage_input(run.parent, evaluation.mlflow_run_id, prompts.eval)
        except Exception as err:
            publish_failure_summary(TITLE, run.dir, run.parent, err, sft=sft, evaluation=evaluation)
            raise
        return publish_summary(TITLE, run.dir, run.parent, sft, evaluation=evaluation)


if __name__ == "__main__":
    from flows.command_line import run_from_command_line

    sys.exit(
        run_from_command_line(evaluate_policy, sys.argv[1:], prog="python -m flows.evaluate_policy", with_policy=True)
    )
