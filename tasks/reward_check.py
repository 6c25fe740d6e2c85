"""Task `load_reward_model`: check every reward source before training, by loading it and probe-scoring.

A reward model gets the checkpoint checks of the SFT model plus `num_labels == 1`, then scores a few
prompt/completion pairs: NaN or constant scores reject it (a broken head or a pooling bug would
otherwise train the policy on noise). Reward functions must import and return one float (or None)
per completion. The probe statistics are recorded in the `reward` MLflow run.
"""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from rloo_engine.config_base import ConfigError
from rloo_engine.pipeline import tracking
from rloo_engine.pipeline.config import DataSection, RewardSection
from rloo_engine.pipeline.input_checkpoints import CheckpointInfo
from rloo_engine.pipeline.reward_probe import probe_rewards
from rloo_engine.pipeline.stage_results import RewardInfo
from rloo_engine.pipeline.tracking import RunRef
from tasks.ingest import ingest_checkpoint


@task(name="load_reward_model", cache_policy=NO_CACHE)
def load_reward_model(
    reward: RewardSection, data: DataSection, sft: CheckpointInfo, dtype: str, run_dir: str, parent: RunRef
) -> RewardInfo:
    """Ingests the reward model (if any), imports the reward functions, and probe-scores all of them."""
    with tracking.stage_run(parent, "reward") as run:
        model = None
        if reward.model:
            model = ingest_checkpoint(reward.model, "reward_model", "reward.model", run_dir, run)
            if model.facts.num_labels != 1:
                raise ConfigError(
                    f"reward.model: {reward.model} has num_labels={model.facts.num_labels}; "
                    "a reward model must have num_labels=1"
                )
        stats, rows = probe_rewards(
            reward, data, sft.local_path, model.local_path if model else None, dtype, get_run_logger()
        )
        for name, s in stats.items():
            tracking.log_metrics(run, {f"probe/{name}/{k}": v for k, v in s.model_dump().items()})
        tracking.client(run.tracking_uri).log_table(run.run_id, data=rows, artifact_file="reward_probe.json")
        tracking.log_params(run, {"reward.functions": reward.functions, "reward.weights": reward.weights})
        return RewardInfo(model=model, functions=list(reward.functions), probe=stats)
