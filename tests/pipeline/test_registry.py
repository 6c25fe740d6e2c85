"""Promotion: the gate decision, transactional registration (alias rolled back on failure), reading a model back."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest

from rloo_engine.pipeline.config import PromotionGate, TrackingSection
from rloo_engine.pipeline.input_checkpoints import (
    CheckpointInfo,
    content_digest,
    inspect_checkpoint,
    materialize_source,
)
from rloo_engine.pipeline.promotion import promotion_decision
from rloo_engine.pipeline.stage_results import EvalSummary, TrainStageResult


def evaluation(ci_low: float | None, pairing: str = "policy_vs_sft", n: int = 64) -> EvalSummary:
    raw = {
        "win_rate": None if ci_low is None else ci_low + 0.1,
        "ci_low": ci_low,
        "ci_high": None if ci_low is None else min(1.0, ci_low + 0.2),
    }
    result = {**raw, **{f"lc_{k}": v for k, v in raw.items()}, "n": n, "n_valid": n if ci_low else 0}
    return EvalSummary(
        pairings={pairing: result},
        paired_difference=None,
        warnings=[],
        results_path="r.json",
        judgments_path="j.jsonl",
        mlflow_run_id="x",
    )


@pytest.mark.parametrize(
    ("ci_low", "threshold", "passed", "reason"),
    [
        (0.55, 0.5, True, "policy_vs_sft length-controlled win rate CI lower bound 0.550 >= min_ci_low 0.500"),
        (0.50, 0.5, True, ">= min_ci_low 0.500"),
        (0.45, 0.5, False, "policy_vs_sft length-controlled win rate CI lower bound 0.450 < min_ci_low 0.500"),
        (None, 0.5, False, "has 0 valid prompts, fewer than promotion.min_n 50"),
    ],
)
def test_gate_compares_the_policy_vs_sft_ci_lower_bound_with_the_threshold(ci_low, threshold, passed, reason):
    decision = promotion_decision(evaluation(ci_low), PromotionGate(min_ci_low=threshold))
    assert decision.passed is passed
    assert reason in decision.reason


def test_gate_refuses_fewer_valid_prompts_than_min_n_whatever_the_interval():
    """3 of 3 won: today's interval says [0.29, 1.0] and fails the 0.5 bar; min_n refuses it even at bar 0."""
    decision = promotion_decision(evaluation(0.29, n=3), PromotionGate(min_ci_low=0.0))
    assert not decision.passed
    assert "has 3 valid prompts, fewer than promotion.min_n 50" in decision.reason
    assert promotion_decision(evaluation(0.29, n=3), PromotionGate(min_ci_low=0.0, min_n=3)).passed


def test_gate_fails_when_policy_vs_sft_was_not_evaluated():
    decision = promotion_decision(evaluation(0.9, pairing="policy_vs_reference"), PromotionGate(min_ci_low=0.5))
    assert not decision.passed and "policy_vs_sft was not evaluated" in decision.reason


def ingested(path: Path) -> CheckpointInfo:
    return CheckpointInfo(
        source=str(path),
        source_kind="local",
        local_path=str(path),
        digest=content_digest(path),
        facts=inspect_checkpoint(path, "causal_lm", "sft.source"),
    )


def promote_flow(services, tracking_cfg: TrackingSection, final_dir: Path, sft: CheckpointInfo, tmp_path: Path,
                 adapter_dir: Path | None = None):
    """A flow that opens a parent run and a finished `train` run (as the pipeline would), then runs the gate."""
    from prefect import flow

    from rloo_engine.pipeline import tracking
    from tasks import registry

    @flow(name="registry-test")
    def promote() -> tuple[registry.Promotion, str, str]:
        parent = tracking.parent_run(services.mlflow_uri, "registry-tests", str(uuid.uuid4()), "promote", {})
        train_run, _ = tracking.child_run(parent, "train")
        with tracking.run_status(train_run):
            tracking.log_metrics(train_run, {"reward": 0.2}, step=8)
        trained = TrainStageResult(
            final_dir=str(final_dir),
            output_dir=str(tmp_path),
            global_step=8,
            metrics={"reward_start": 0.1, "reward_end": 0.2},
            reward_curve=None,
            log_path=str(tmp_path / "train.log"),
            mlflow_run_id=train_run.run_id,
            attempts=1,
            adapter_dir=str(adapter_dir) if adapter_dir else None,
        )
        return registry.register_policy(tracking_cfg, trained, evaluation(0.6), sft, parent), train_run.run_id, parent.run_id

    return promote


@pytest.mark.slow
def test_registration_rolls_back_the_alias_when_a_later_step_fails(services, qwen2_model, tmp_path, monkeypatch):
    from tasks import registry

    name = "tiny-policy-rollback"
    tracking_cfg = TrackingSection(registered_model=name, promotion=PromotionGate(min_ci_low=0.5, alias="candidate"))
    sft = ingested(Path(qwen2_model))
    promote = promote_flow(services, tracking_cfg, Path(qwen2_model), sft, tmp_path)

    client = services.mlflow()
    with services.prefect_settings():
        first, _, _ = promote()
        assert first.registered and first.version == "1"
        assert client.get_model_version_by_alias(name, "candidate").version == "1"

        def fail_after_registration(*args, **kwargs):
            raise RuntimeError("describing the version failed")

        monkeypatch.setattr(registry, "_version_description", fail_after_registration)
        with pytest.raises(RuntimeError, match="describing the version failed"):
            promote()

    # Version 2 was created, then rolled back: the alias is where it was and version 2 is gone.
    assert client.get_model_version_by_alias(name, "candidate").version == "1"
    assert [v.version for v in client.search_model_versions(f"name = '{name}'")] == ["1"]

    # The registered model can be ingested again through its models:/ URI: same weights, same digest.
    local, kind = materialize_source(
        f"models:/{name}@candidate", "sft.source", tmp_path / "download", tracking_uri=services.mlflow_uri
    )
    assert kind == "mlflow" and content_digest(local) == sft.digest


@pytest.mark.slow
def test_a_registered_policy_is_a_transformers_logged_model_that_predicts(services, qwen2_model, tmp_path, monkeypatch):
    """The version, the training run and the LoggedModel point at each other, and pyfunc predict returns completions."""
    import mlflow.pyfunc

    name = "tiny-policy-predict"
    tracking_cfg = TrackingSection(registered_model=name, promotion=PromotionGate(min_ci_low=0.5, alias="candidate"))
    sft = ingested(Path(qwen2_model))
    with services.prefect_settings():
        promotion, train_run_id, parent_run_id = promote_flow(services, tracking_cfg, Path(qwen2_model), sft, tmp_path)()
    assert promotion.registered

    client = services.mlflow()
    version = client.get_model_version_by_alias(name, "candidate")
    model_id = version.source.removeprefix("models:/")
    assert version.source.startswith("models:/m-") and version.run_id == train_run_id
    model = client.get_logged_model(model_id)
    assert model.source_run_id == train_run_id and model.status.to_proto() == model.status.READY.to_proto()
    linked = json.loads(model.tags["mlflow.modelVersions"])  # what the model page lists as its versions
    assert [(v["name"], str(v["version"])) for v in linked] == [(name, str(version.version))]
    assert [m.key for m in model.metrics] == ["reward"]  # the training run's metrics at the final step
    train_run = client.get_run(train_run_id)
    assert [o.model_id for o in train_run.outputs.model_outputs] == [model_id]
    register_run = next(
        r for r in client.search_runs([train_run.info.experiment_id], f"tags.`mlflow.parentRunId` = '{parent_run_id}'")
        if r.data.tags["rloo.stage"] == "register"
    )
    assert [i.model_id for i in client.get_run(register_run.info.run_id).inputs.model_inputs] == [model_id]
    assert [o.model_id for o in client.get_run(parent_run_id).outputs.model_outputs] == [model_id]

    # Served like MLflow serves it: the transformers flavor's pyfunc, from the registry alias.
    monkeypatch.setenv("MLFLOW_TRACKING_URI", services.mlflow_uri)
    loaded = mlflow.pyfunc.load_model(f"models:/{name}@candidate")
    assert loaded.metadata.flavors["transformers"]["task"] == "text-generation"
    prompts = ["the quick brown", "a lazy dog"]
    completions = loaded.predict(prompts, params={"max_new_tokens": 5})
    assert isinstance(completions, list) and len(completions) == 2
    assert all(isinstance(c, str) and c.strip() for c in completions)
    assert not any(c.startswith(p) for c, p in zip(completions, prompts, strict=True))  # completions, not echoes
