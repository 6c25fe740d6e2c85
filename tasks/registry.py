"""Task `register_policy`: the promotion gate, and registration of a passing policy in the MLflow Model Registry.

The gate: the lower bound of the policy-vs-SFT win-rate CI must reach `tracking.promotion.min_ci_low`.
A passing policy's checkpoint (for a LoRA run the merged copy, `final-merged/`: a whole model that MLflow serves
without the base; tag `rloo.weights` says which) is logged as a LoggedModel of MLflow's transformers flavor
(`rloo_engine/pipeline/policy_model.py`) with the training run as its source run and this stage's run as a user of
it, registered from that model, and the alias (e.g. `candidate`) is moved to the new version.
Registration and the steps after it run in a Prefect transaction: if anything fails after the
version was created, the rollback hook moves the alias back (or removes it) and deletes the
version, so the registry never points at a half-recorded promotion.
"""

from __future__ import annotations

import json

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.transactions import get_transaction, transaction
from pydantic import BaseModel

from rloo_engine.pipeline import tracking
from rloo_engine.pipeline.config import TrackingSection
from rloo_engine.pipeline.input_checkpoints import CheckpointInfo
from rloo_engine.pipeline.policy_model import log_policy_model
from rloo_engine.pipeline.promotion import GATE_PAIRING, promotion_decision
from rloo_engine.pipeline.stage_results import EvalSummary, Promotion, TrainStageResult
from rloo_engine.pipeline.tracking import RunRef

MODEL_VERSIONS_TAG = "mlflow.modelVersions"


class RegisteredVersion(BaseModel):
    model_name: str
    alias: str
    version: str
    previous_version: str | None
    model_uri: str
    logged_model_id: str


@task(name="register_policy", cache_policy=NO_CACHE)
def register_policy(
    tracking_cfg: TrackingSection,
    trained: TrainStageResult,
    evaluation: EvalSummary,
    sft: CheckpointInfo,
    parent: RunRef,
) -> Promotion:
    """Applies the gate; on a pass registers the final checkpoint and moves the alias (transactionally)."""
    from mlflow.entities import LoggedModelOutput

    logger = get_run_logger()
    gate = tracking_cfg.promotion
    with tracking.stage_run(parent, "register") as run:
        decision = promotion_decision(evaluation, gate)
        tracking.log_metrics(
            run, {"gate/passed": decision.passed, "gate/ci_low": decision.ci_low, "gate/min_ci_low": decision.threshold}
        )
        gate_tags = {"rloo.gate": "passed" if decision.passed else "failed", "rloo.gate_reason": decision.reason,
                     "rloo.gate_rate": decision.rate}
        tracking.set_tags(run, gate_tags)
        tracking.set_tags(parent, gate_tags)
        promotion = Promotion(
            decision=decision, registered=False, model_name=tracking_cfg.registered_model, alias=gate.alias
        )
        if not decision.passed:
            logger.info("not registered: %s", decision.reason)
            return promotion
        logger.info("gate passed: %s", decision.reason)
        with transaction():
            registered = register_model_version(
                tracking_cfg.registered_model, gate.alias, trained, sft, decision.reason, run
            )
            describe_model_version(registered, trained, evaluation, sft, parent)
        logger.info("registered %s version %s as @%s", registered.model_name, registered.version, gate.alias)
        tracking.set_tags(parent, {"rloo.registered_version": registered.version})
        # The pipeline run is what produced the model, so the runs table shows it on the parent row too.
        tracking.client(parent.tracking_uri).log_outputs(
            parent.run_id, [LoggedModelOutput(registered.logged_model_id, step=trained.global_step)]
        )
        return promotion.model_copy(
            update={"registered": True, **registered.model_dump(exclude={"model_name", "alias", "logged_model_id"})}
        )


@task(name="register_model_version", cache_policy=NO_CACHE)
def register_model_version(
    name: str, alias: str, trained: TrainStageResult, sft: CheckpointInfo, gate_reason: str, stage: RunRef
) -> RegisteredVersion:
    """Logs the final checkpoint as a LoggedModel of the training run, registers a version of it, moves the alias."""
    from mlflow.entities import LoggedModelInput

    c = tracking.client(stage.tracking_uri)
    model_uri = log_policy_model(
        trained.final_dir,
        tracking_uri=stage.tracking_uri,
        experiment_id=stage.experiment_id,
        train_run_id=trained.mlflow_run_id,
        step=trained.global_step,
        description=f"Trained from `{sft.source}` (sha256 {sft.digest[:12]}) for {trained.global_step} steps; "
        f"promoted because {gate_reason}. {_weights_note(trained)}",
        tags={"rloo.sft_digest": sft.digest, "rloo.stage": "train", **_weights_tags(trained)},
    )
    model_id = model_uri.removeprefix("models:/")
    c.log_inputs(stage.run_id, models=[LoggedModelInput(model_id)])  # the register run used this model
    try:
        c.get_registered_model(name)
    except Exception:
        c.create_registered_model(name, description="RLOO policies promoted by the rlhf-pipeline flow")
    previous = _alias_version(c, name, alias)
    mv = c.create_model_version(name, source=model_uri, run_id=trained.mlflow_run_id, model_id=model_id)
    version = str(mv.version)  # a SQL store answers an int, a tracking server a string
    get_transaction().set(
        "registration",
        {
            "tracking_uri": stage.tracking_uri,
            "name": name,
            "alias": alias,
            "version": version,
            "previous": previous,
            "model_id": model_id,
        },
    )
    _set_model_version_links(c, model_id, name, version, linked=True)
    c.set_registered_model_alias(name, alias, version)
    return RegisteredVersion(
        model_name=name,
        alias=alias,
        version=version,
        previous_version=previous,
        model_uri=f"models:/{name}@{alias}",
        logged_model_id=model_id,
    )


@register_model_version.on_rollback
def _undo_registration(txn) -> None:
    """Moves the alias back to the version it had (or removes it) and deletes the new version."""
    reg = txn.get("registration", None)
    if not reg:
        return
    c = tracking.client(reg["tracking_uri"])
    if reg["previous"]:
        c.set_registered_model_alias(reg["name"], reg["alias"], reg["previous"])
    else:
        try:
            c.delete_registered_model_alias(reg["name"], reg["alias"])
        except Exception:
            pass  # the alias was never set
    c.delete_model_version(reg["name"], reg["version"])
    _set_model_version_links(c, reg["model_id"], reg["name"], reg["version"], linked=False)


def _set_model_version_links(c, model_id: str, name: str, version: str, linked: bool) -> None:
    """Adds (or removes) the version in the LoggedModel's `mlflow.modelVersions` tag, which its UI page lists.

    A tracking server adds it itself when the version is created; a client on a SQL store directly
    (the demo) does not. Written idempotently, so both end with one entry."""
    tag = c.get_logged_model(model_id).tags.get(MODEL_VERSIONS_TAG)
    entries = [v for v in (json.loads(tag) if tag else []) if (v["name"], str(v["version"])) != (name, version)]
    if linked:
        entries.append({"name": name, "version": version})
    c.set_logged_model_tags(model_id, {MODEL_VERSIONS_TAG: json.dumps(entries)})


@task(name="describe_model_version", cache_policy=NO_CACHE)
def describe_model_version(
    registered: RegisteredVersion, trained: TrainStageResult, evaluation: EvalSummary, sft: CheckpointInfo, parent: RunRef
) -> None:
    """Tags the new version with where it came from and how it scored (lineage for whoever deploys it)."""
    c = tracking.client(parent.tracking_uri)
    parent_tags = c.get_run(parent.run_id).data.tags
    gate = evaluation.pairings.get(GATE_PAIRING, {})
    tags = {
        "prefect.flow_run_id": parent_tags.get(tracking.TAG_FLOW_RUN, ""),
        "mlflow.parent_run_id": parent.run_id,
        "sft_digest": sft.digest,
        "sft_source": sft.source,
        "global_step": trained.global_step,
        f"{GATE_PAIRING}.win_rate": _rate(gate.get("win_rate")),
        f"{GATE_PAIRING}.ci_low": _rate(gate.get("ci_low")),
        f"{GATE_PAIRING}.ci_high": _rate(gate.get("ci_high")),
    }
    for key, value in {**tags, **_weights_tags(trained)}.items():
        c.set_model_version_tag(registered.model_name, registered.version, key, str(value))
    c.update_model_version(registered.model_name, registered.version, description=_version_description(trained, gate))


def _version_description(trained: TrainStageResult, gate: dict) -> str:
    reward = trained.metrics
    return (
        f"RLOO policy after {trained.global_step} steps (reward {reward.get('reward_start', float('nan')):.4f} -> "
        f"{reward.get('reward_end', float('nan')):.4f}); {GATE_PAIRING} win rate {_rate(gate.get('win_rate'))} "
        f"CI [{_rate(gate.get('ci_low'))}, {_rate(gate.get('ci_high'))}]. {_weights_note(trained)}"
    )


def _rate(value: float | None) -> str:
    """A rate as the summaries print it (4 decimals: a CI's bound is not known to 17 digits); `n/a` when missing."""
    return "n/a" if value is None else f"{value:.4f}"


def _weights_tags(trained: TrainStageResult) -> dict[str, str]:
    """`rloo.weights`: `full` (all weights trained) or `lora-merged` (a LoRA run's adapter merged into the SFT base);
    either way the registered model is a whole causal LM that `mlflow.pyfunc.load_model` and `mlflow models serve`
    run without the base. A LoRA version also names the adapter it was merged from."""
    if trained.adapter_dir is None:
        return {"rloo.weights": "full"}
    return {"rloo.weights": "lora-merged", "rloo.adapter_dir": trained.adapter_dir}


def _weights_note(trained: TrainStageResult) -> str:
    if trained.adapter_dir is None:
        return "Weights: the full fine-tuned model."
    return (f"Weights: the LoRA adapter merged into the SFT base (a whole model, servable alone); the adapter itself "
            f"is `{trained.adapter_dir}` (PEFT layout, base = the SFT checkpoint).")


def _alias_version(c, name: str, alias: str) -> str | None:
    try:
        return str(c.get_model_version_by_alias(name, alias).version)
    except Exception:
        return None
