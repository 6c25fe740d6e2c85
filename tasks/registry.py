"""Task `register_policy`: the promotion gate, and registration of a passing policy in the MLflow Model Registry.

The gate: the lower bound of the policy-vs-SFT win-rate CI must reach `tracking.promotion.min_ci_low`.
A passing policy is registered as a pyfunc model (`tasks/policy_model.py`, models-from-code) whose
`checkpoint` artifact is the HF checkpoint, and the alias (e.g. `candidate`) is moved to the new
version. Registration and the steps after it run in a Prefect transaction: if anything fails after
the version was created, the rollback hook moves the alias back (or removes it) and deletes the
version, so the registry never points at a half-recorded promotion.
"""

from __future__ import annotations

import shutil
import warnings
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.transactions import get_transaction, transaction
from pydantic import BaseModel

from tasks import tracking
from tasks.checkpoints import CheckpointInfo
from tasks.config import PromotionGate, TrackingSection
from tasks.evaluate import EvalSummary
from tasks.secrets import scoped_env
from tasks.tracking import RunRef
from tasks.train import TrainResult

POLICY_MODEL_FILE = Path(__file__).with_name("policy_model.py")
GATE_PAIRING = "policy_vs_sft"


class GateDecision(BaseModel):
    passed: bool
    reason: str
    ci_low: float | None
    threshold: float


class RegisteredVersion(BaseModel):
    model_name: str
    alias: str
    version: str
    previous_version: str | None
    model_uri: str


class Promotion(BaseModel):
    decision: GateDecision
    registered: bool
    model_name: str
    alias: str
    version: str | None = None
    previous_version: str | None = None
    model_uri: str | None = None


def promotion_decision(evaluation: EvalSummary, gate: PromotionGate) -> GateDecision:
    """Passes when policy_vs_sft's CI lower bound >= gate.min_ci_low; the reason says why either way."""
    result = evaluation.pairings.get(GATE_PAIRING)
    threshold = gate.min_ci_low
    if result is None:
        return GateDecision(
            passed=False,
            ci_low=None,
            threshold=threshold,
            reason=f"{GATE_PAIRING} was not evaluated (see evaluation.pairings); the promotion gate needs it",
        )
    ci_low, n_valid = result.get("ci_low"), result.get("n_valid")
    if ci_low is None:
        return GateDecision(
            passed=False,
            ci_low=None,
            threshold=threshold,
            reason=f"{GATE_PAIRING} has no confidence interval ({n_valid} valid judgments of {result.get('n')})",
        )
    rate = result.get("win_rate")
    detail = f"win rate {rate:.3f}, CI [{ci_low:.3f}, {result.get('ci_high'):.3f}], n={result.get('n')}"
    if ci_low >= threshold:
        return GateDecision(
            passed=True,
            ci_low=ci_low,
            threshold=threshold,
            reason=f"{GATE_PAIRING} CI lower bound {ci_low:.3f} >= min_ci_low {threshold:.3f} ({detail})",
        )
    return GateDecision(
        passed=False,
        ci_low=ci_low,
        threshold=threshold,
        reason=f"{GATE_PAIRING} CI lower bound {ci_low:.3f} < min_ci_low {threshold:.3f} ({detail})",
    )


@task(name="register_policy", cache_policy=NO_CACHE)
def register_policy(
    tracking_cfg: TrackingSection,
    trained: TrainResult,
    evaluation: EvalSummary,
    sft: CheckpointInfo,
    run_dir: str,
    parent: RunRef,
) -> Promotion:
    """Applies the gate; on a pass registers the final checkpoint and moves the alias (transactionally)."""
    logger = get_run_logger()
    gate = tracking_cfg.promotion
    with tracking.stage_run(parent, "register") as run:
        decision = promotion_decision(evaluation, gate)
        tracking.log_metrics(
            run, {"gate/passed": decision.passed, "gate/ci_low": decision.ci_low, "gate/min_ci_low": decision.threshold}
        )
        gate_tags = {"rloo.gate": "passed" if decision.passed else "failed", "rloo.gate_reason": decision.reason}
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
                tracking_cfg.registered_model, gate.alias, trained.final_dir, run_dir, run
            )
            describe_model_version(registered, trained, evaluation, sft, parent)
        logger.info("registered %s version %s as @%s", registered.model_name, registered.version, gate.alias)
        tracking.set_tags(parent, {"rloo.registered_version": registered.version})
        return promotion.model_copy(
            update={"registered": True, **registered.model_dump(exclude={"model_name", "alias"})}
        )


@task(name="register_model_version", cache_policy=NO_CACHE)
def register_model_version(name: str, alias: str, final_dir: str, run_dir: str, stage: RunRef) -> RegisteredVersion:
    """Logs the checkpoint as a pyfunc model to the `register` run, creates a version, moves the alias."""
    import mlflow.pyfunc
    from mlflow.models import infer_signature

    c = tracking.client(stage.tracking_uri)
    model_dir = Path(run_dir) / "registry" / "policy"
    shutil.rmtree(model_dir, ignore_errors=True)
    model_dir.parent.mkdir(parents=True, exist_ok=True)
    # Prompts in, completions out; generation options as params. Given explicitly, so saving never runs the model.
    signature = infer_signature(["a prompt"], ["a completion"], params={"max_new_tokens": 128, "do_sample": False})
    with scoped_env({"MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false"}), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*input example", category=UserWarning)  # the signature is explicit
        mlflow.pyfunc.save_model(
            str(model_dir),
            python_model=str(POLICY_MODEL_FILE),
            artifacts={"checkpoint": final_dir},
            pip_requirements=_requirements(),
            signature=signature,
        )
    c.log_artifacts(stage.run_id, str(model_dir), "policy")
    try:
        c.get_registered_model(name)
    except Exception:
        c.create_registered_model(name, description="RLOO policies promoted by the rlhf-pipeline flow")
    previous = _alias_version(c, name, alias)
    artifact_uri = c.get_run(stage.run_id).info.artifact_uri
    mv = c.create_model_version(name, source=f"{artifact_uri}/policy", run_id=stage.run_id)
    version = str(mv.version)  # a SQL store answers an int, a tracking server a string
    get_transaction().set(
        "registration",
        {"tracking_uri": stage.tracking_uri, "name": name, "alias": alias, "version": version, "previous": previous},
    )
    c.set_registered_model_alias(name, alias, version)
    return RegisteredVersion(
        model_name=name, alias=alias, version=version, previous_version=previous, model_uri=f"models:/{name}@{alias}"
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


@task(name="describe_model_version", cache_policy=NO_CACHE)
def describe_model_version(
    registered: RegisteredVersion, trained: TrainResult, evaluation: EvalSummary, sft: CheckpointInfo, parent: RunRef
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
        f"{GATE_PAIRING}.win_rate": gate.get("win_rate"),
        f"{GATE_PAIRING}.ci_low": gate.get("ci_low"),
        f"{GATE_PAIRING}.ci_high": gate.get("ci_high"),
    }
    for key, value in tags.items():
        c.set_model_version_tag(registered.model_name, registered.version, key, str(value))
    c.update_model_version(registered.model_name, registered.version, description=_version_description(trained, gate))


def _version_description(trained: TrainResult, gate: dict) -> str:
    reward = trained.metrics
    return (
        f"RLOO policy after {trained.global_step} steps (reward {reward.get('reward_start', float('nan')):.4f} -> "
        f"{reward.get('reward_end', float('nan')):.4f}); {GATE_PAIRING} win rate {gate.get('win_rate')} "
        f"CI [{gate.get('ci_low')}, {gate.get('ci_high')}]."
    )


def _alias_version(c, name: str, alias: str) -> str | None:
    try:
        return str(c.get_model_version_by_alias(name, alias).version)
    except Exception:
        return None


def _requirements() -> list[str]:
    reqs = ["mlflow"]
    for package in ("torch", "transformers"):
        try:
            reqs.append(f"{package}>={version(package).split('+')[0]}")
        except PackageNotFoundError:
            reqs.append(package)
    return reqs
