"""Flow `rlhf-pipeline`: check eval inputs -> ingest SFT -> check rewards -> RLOO -> judge win rates -> promotion gate.

    python -m flows.rlhf_pipeline --config configs/pipeline_example.yaml [--set train.max_steps=100 ...]
    prefect deployment run 'rlhf-pipeline/on-demand' --param overrides='{"train.learning_rate": 3e-6}'

`cfg` is validated by Prefect before the run starts; `overrides` (dotted keys) are applied and
validated first thing. The flow returns the run summary (reward start/end, KL, win rates with CIs,
gate result, MLflow run URL), which is also the `rlhf-summary` markdown artifact.
"""

from __future__ import annotations

import sys
from typing import Any

from prefect import flow

from rloo_engine.pipeline.config import PipelineConfig
from rloo_engine.pipeline.tracking import end_runs_of_crashed_flow_run, run_status
from tasks.datasets import log_stage_input, record_prompt_sets
from tasks.evaluate import check_evaluation_inputs, evaluate_win_rate
from tasks.ingest import ingest_sft_checkpoint
from tasks.registry import register_policy
from tasks.reward_check import load_reward_model
from tasks.run_setup import check_crash_reruns, open_pipeline_run
from tasks.summary import publish_failure_summary, publish_summary
from tasks.train import train_rloo

TITLE = "RLHF pipeline"


# on_crashed: the worker ends the MLflow runs a SIGKILLed flow-run process left RUNNING.
@flow(name="rlhf-pipeline", log_prints=True, on_crashed=[end_runs_of_crashed_flow_run])
def rlhf_pipeline(cfg: PipelineConfig, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """RLOO fine-tuning of an SFT checkpoint, judged against SFT and references, registered when it wins.

    Args:
        cfg: the pipeline configuration (see configs/pipeline_example.yaml).
        overrides: dotted-key changes applied to `cfg`, e.g. {"train.learning_rate": 3e-6}.
    """
    cfg = cfg.with_overrides(overrides)
    check_crash_reruns(cfg)  # a crashed run rescheduled by the automation resumes; a crash loop stops
    train = train_rloo.with_options(retries=cfg.launch.retries, retry_delay_seconds=cfg.launch.retry_delay_seconds)
    run = open_pipeline_run(cfg, "rlhf-pipeline")
    sft = reward = policy = evaluation = promotion = None
    with run_status(run.parent):
        try:
            check_evaluation_inputs(cfg)  # judge, eval prompts, references: fail now, not after training
            prompts = record_prompt_sets(cfg.data, run.parent)
            sft = ingest_sft_checkpoint(cfg.sft, run.dir, run.parent)
            reward = load_reward_model(cfg.reward, cfg.data, sft, cfg.train.dtype, run.dir, run.parent)
            policy = train(cfg, sft, reward, run.dir, run.parent)
            log_stage_input(run.parent, policy.mlflow_run_id, prompts.train)
            evaluation = evaluate_win_rate(cfg, policy.final_dir, sft.local_path, run.dir, run.parent)
            log_stage_input(run.parent, evaluation.mlflow_run_id, prompts.eval)
            promotion = register_policy(cfg.tracking, policy, evaluation, sft, run.parent)
        except Exception as err:
            publish_failure_summary(
                TITLE,
                run.dir,
                run.parent,
                err,
                sft=sft,
                reward=reward,
                trained=policy,
                evaluation=evaluation,
                promotion=promotion,
            )
            raise
        return publish_summary(TITLE, run.dir, run.parent, sft, reward, policy, evaluation, promotion)


if __name__ == "__main__":
    from flows.command_line import run_from_command_line

    sys.exit(run_from_command_line(rlhf_pipeline, sys.argv[1:], prog="python -m flows.rlhf_pipeline"))
