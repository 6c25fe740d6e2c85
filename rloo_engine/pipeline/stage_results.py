"""What each pipeline stage hands to the next (and to the summary): paths, digests, run ids and numbers, never
model objects. Plain pydantic models, so Prefect can store them as task results and the library can read them."""

from __future__ import annotations

from pydantic import BaseModel

from rloo_engine.evaluation.report import PairingResult
from rloo_engine.pipeline.input_checkpoints import CheckpointInfo

# Every numeric statistic of the library's PairingResult, so one added there is logged and handed on as well.
PAIRING_METRICS = tuple(
    name for name, f in PairingResult.model_fields.items() if f.annotation in (int, float, float | None)
)


class RewardStats(BaseModel):
    mean: float | None
    std: float | None
    min: float | None
    max: float | None
    n_scored: int


class RewardInfo(BaseModel):
    """The checked reward sources, and what each scored on the probe."""

    model: CheckpointInfo | None
    functions: list[str]
    probe: dict[str, RewardStats]


class TrainStageResult(BaseModel):
    """What the train stage hands on: the final checkpoint, the summary metrics and where the logs are."""

    final_dir: str  # a whole causal LM: `final/`, or a LoRA run's `final-merged/`; what is evaluated and registered
    output_dir: str
    global_step: int
    metrics: dict[str, float]  # reward_start, reward_end, kl_end, ... from metrics.jsonl
    reward_curve: str | None
    log_path: str
    mlflow_run_id: str
    attempts: int
    adapter_dir: str | None = None  # a LoRA run's adapter (`final/`, PEFT layout), whose base is the SFT checkpoint


class EvalSummary(BaseModel):
    """What the flow and the promotion gate need from an evaluation; the full report stays in results.json."""

    pairings: dict[str, dict[str, float | int | str | None]]
    paired_difference: dict[str, float | int | str | None] | None
    warnings: list[str]
    results_path: str
    judgments_path: str
    mlflow_run_id: str


def pairing_summary(result: PairingResult) -> dict[str, float | int | str | None]:
    """What EvalSummary keeps of a pairing: its numbers, and why a controlled rate is missing."""
    values = result.model_dump()
    return {k: values.get(k) for k in (*PAIRING_METRICS, "lc_not_estimable", "sc_not_estimable")}


class GateDecision(BaseModel):
    passed: bool
    reason: str
    ci_low: float | None  # of the rate gated on
    threshold: float
    rate: str = "length_controlled"  # promotion.rate: which policy-vs-SFT rate the gate read


class Promotion(BaseModel):
    decision: GateDecision
    registered: bool
    model_name: str
    alias: str
    version: str | None = None
    previous_version: str | None = None
    model_uri: str | None = None
