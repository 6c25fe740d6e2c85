"""Promotion: the gate decision, transactional registration (alias rolled back on failure), reading a model back."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from tasks.checkpoints import CheckpointInfo, content_digest, inspect_checkpoint, materialize_source
from tasks.config import PromotionGate, TrackingSection
from tasks.evaluate import EvalSummary
from tasks.registry import promotion_decision
from tasks.train import TrainResult


def evaluation(ci_low: float | None, pairing: str = "policy_vs_sft") -> EvalSummary:
    result = {
        "win_rate": None if ci_low is None else ci_low + 0.1,
        "ci_low": ci_low,
        "ci_high": None if ci_low is None else min(1.0, ci_low + 0.2),
        "n": 16,
        "n_valid": 16 if ci_low else 0,
    }
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
        (0.55, 0.5, True, "policy_vs_sft CI lower bound 0.550 >= min_ci_low 0.500"),
        (0.50, 0.5, True, ">= min_ci_low 0.500"),
        (0.45, 0.5, False, "policy_vs_sft CI lower bound 0.450 < min_ci_low 0.500"),
        (None, 0.5, False, "has no confidence interval (0 valid judgments of 16)"),
    ],
)
def test_gate_compares_the_policy_vs_sft_ci_lower_bound_with_the_threshold(ci_low, threshold, passed, reason):
    decision = promotion_decision(evaluation(ci_low), PromotionGate(min_ci_low=threshold))
    assert decision.passed is passed
    assert reason in decision.reason


def test_gate_fails_when_policy_vs_sft_was_not_evaluated():
    decision = promotion_decision(evaluation(0.9, pairing="policy_vs_reference"), PromotionGate(min_ci_low=0.5))
    assert not decision.passed and "policy_vs_sft was not evaluated" in decision.reason


@pytest.mark.slow
def test_registration_rolls_back_the_alias_when_a_later_step_fails(services, qwen2_model, tmp_path, monkeypatch):
    from prefect import flow

    from tasks import registry, tracking

    name = "tiny-policy-rollback"
    tracking_cfg = TrackingSection(registered_model=name, promotion=PromotionGate(min_ci_low=0.5, alias="candidate"))
    digest = content_digest(Path(qwen2_model))
    sft = CheckpointInfo(
        source=str(qwen2_model),
        source_kind="local",
        local_path=str(qwen2_model),
        digest=digest,
        facts=inspect_checkpoint(Path(qwen2_model), "causal_lm", "sft.source"),
    )
    trained = TrainResult(
        final_dir=str(qwen2_model),
        output_dir=str(tmp_path),
        global_step=8,
        metrics={"reward_start": 0.1, "reward_end": 0.2},
        reward_curve=None,
        log_path=str(tmp_path / "train.log"),
        mlflow_run_id="none",
        attempts=1,
    )

    @flow(name="registry-test")
    def promote() -> registry.Promotion:
        parent = tracking.parent_run(services.mlflow_uri, "registry-tests", str(uuid.uuid4()), "promote", {})
        return registry.register_policy(tracking_cfg, trained, evaluation(0.6), sft, str(tmp_path), parent)

    client = services.mlflow()
    with services.prefect_settings():
        first = promote()
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
    assert kind == "mlflow" and content_digest(local) == digest
