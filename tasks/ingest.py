"""Task `ingest_sft_checkpoint`: resolve the SFT checkpoint to a local dir, digest it, check it loads, record it.

The inspection is cached on the weights' content digest, so ingesting the same checkpoint again (in
this or any later flow run on a worker sharing the result storage) is skipped.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from rloo_engine.config_base import ConfigError
from rloo_engine.pipeline import tracking
from rloo_engine.pipeline.config import SFTSection
from rloo_engine.pipeline.input_checkpoints import (
    CheckpointFacts,
    CheckpointInfo,
    Kind,
    content_digest,
    inspect_checkpoint,
    materialize_source,
)
from rloo_engine.pipeline.tracking import RunRef

INSPECTION_VERSION = 2  # bump when inspect_checkpoint changes what it checks or records, to invalidate the cache


def _digest_cache_key(context, parameters) -> str:
    return f"checkpoint-facts-v{INSPECTION_VERSION}-{parameters['kind']}-{parameters['digest']}"


@task(
    name="inspect_checkpoint",
    cache_key_fn=_digest_cache_key,
    cache_expiration=timedelta(days=90),
    persist_result=True,
)
def inspect_checkpoint_cached(local_path: str, digest: str, kind: Kind, field: str) -> CheckpointFacts:
    """Meta-device load check; runs once per (kind, digest) and is served from the cache afterwards."""
    facts = inspect_checkpoint(Path(local_path), kind, field)
    get_run_logger().info(
        "%s: %s, %s parameters, %s, tokenizer %s (pad=%r, eos=%r, chat template: %s)",
        field,
        facts.architecture,
        f"{facts.num_parameters:,}",
        facts.dtype,
        facts.tokenizer_class,
        facts.pad_token,
        facts.eos_token,
        "yes" if facts.has_chat_template else "no",
    )
    return facts


def ingest_checkpoint(
    source: str, kind: Kind, field: str, run_dir: str, stage: RunRef, revision: str | None = None
) -> CheckpointInfo:
    """Resolves, digests and inspects one checkpoint, logging what it found to the `stage` MLflow run."""
    logger = get_run_logger()
    download_dir = Path(run_dir) / "downloads" / field.replace(".", "_")
    local, source_kind = materialize_source(source, field, download_dir, revision, stage.tracking_uri)
    digest = content_digest(local)
    logger.info("%s: %s -> %s (%s)", field, source, local, digest)
    facts = inspect_checkpoint_cached(str(local), digest, kind, field)
    info = CheckpointInfo(source=source, source_kind=source_kind, local_path=str(local), digest=digest, facts=facts)
    prefix = field.split(".")[0]
    tracking.log_params(stage, {f"{prefix}.{k}": v for k, v in info.summary().items()})
    tracking.log_metrics(
        stage, {f"{prefix}.num_parameters": facts.num_parameters, f"{prefix}.weight_bytes": facts.weight_bytes}
    )
    return info


@task(name="ingest_sft_checkpoint", cache_policy=NO_CACHE)
def ingest_sft_checkpoint(sft: SFTSection, run_dir: str, parent: RunRef) -> CheckpointInfo:
    """The SFT checkpoint (local dir, hub id or MLflow model URI), checked and recorded in the `ingest` run."""
    with tracking.stage_run(parent, "ingest") as run:
        info = ingest_checkpoint(sft.source, "causal_lm", "sft.source", run_dir, run, sft.revision)
        if info.facts.eos_token is None:
            raise ConfigError(
                f"sft.source: {sft.source} has a tokenizer without an eos_token; completions could never end"
            )
        tracking.set_tags(parent, {"rloo.sft_digest": info.digest})
        # On the parent too, as a param: the runs table's Compare view lines flow runs up by their params.
        tracking.log_params(parent, {"sft.digest": info.digest})
        return info


@task(name="ingest_policy_checkpoint", cache_policy=NO_CACHE)
def ingest_policy_checkpoint(source: str, run_dir: str, parent: RunRef) -> CheckpointInfo:
    """A policy to evaluate (checkpoint dir, hub id, `models:/name@alias`), checked and recorded in `ingest_policy`."""
    with tracking.stage_run(parent, "ingest_policy") as run:
        info = ingest_checkpoint(source, "causal_lm", "policy", run_dir, run)
        tracking.set_tags(parent, {"rloo.policy_digest": info.digest})
        return info
