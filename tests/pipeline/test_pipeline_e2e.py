"""End to end: `prefect deployment run 'rlhf-pipeline/on-demand' --watch` via a real worker, servers and registry."""

from __future__ import annotations

import json
import re

import pytest

pytestmark = pytest.mark.slow

STAGES = {"ingest", "reward", "train", "evaluate", "register"}
PAIRINGS = ("policy_vs_reference", "sft_vs_reference", "policy_vs_sft")


def test_on_demand_run_is_tracked_and_registered_when_the_gate_passes(deployed):
    overrides = {"tracking.registered_model": "tiny-policy-pass"}
    flow_run_id, cli = deployed.run("rlhf-pipeline/on-demand", "--param", f"overrides={json.dumps(overrides)}")
    assert cli.returncode == 0, cli.stdout + cli.stderr + deployed.worker.log_tail(80)
    assert deployed.flow_run(flow_run_id).state.name == "Completed"

    runs = deployed.mlflow_runs(flow_run_id)
    assert set(runs) == STAGES | {"pipeline"}
    parent = runs.pop("pipeline")
    for stage, run in runs.items():
        assert run.data.tags["mlflow.parentRunId"] == parent.info.run_id, stage
        assert run.info.status == "FINISHED", stage
    assert parent.info.status == "FINISHED"
    assert parent.data.tags["prefect.deployment"] == "rlhf-pipeline/on-demand"
    assert parent.data.tags["rloo.sft_digest"].startswith("sha256:")
    assert parent.data.tags["mlflow.source.git.commit"] != ""
    assert parent.data.params["train.learning_rate"] == "0.003"
    assert parent.data.params["train.num_generations"] == "4"

    client = deployed.services.mlflow()
    reward_history = client.get_metric_history(runs["train"].info.run_id, "reward")
    assert [m.step for m in reward_history] == [2, 4, 6, 8]
    train_artifacts = {a.path for a in client.list_artifacts(runs["train"].info.run_id)}
    assert {"reward_curve.png", "metrics.jsonl", "config.yaml", "completions.json", "logs"} <= train_artifacts

    eval_metrics = runs["evaluate"].data.metrics
    for pairing in PAIRINGS:
        low, rate, high = (eval_metrics[f"{pairing}/{k}"] for k in ("ci_low", "win_rate", "ci_high"))
        assert 0.0 <= low <= rate <= high <= 1.0, pairing
        assert eval_metrics[f"{pairing}/n"] == 16
        assert eval_metrics[f"{pairing}/n_parse_error"] == 0 and eval_metrics[f"{pairing}/n_api_error"] == 0
    eval_artifacts = {a.path for a in client.list_artifacts(runs["evaluate"].info.run_id)}
    assert {"judgments.json", "results.json", "judgments.jsonl"} <= eval_artifacts
    judgments = json.loads(open(client.download_artifacts(runs["evaluate"].info.run_id, "judgments.json")).read())
    assert len(judgments["data"]) >= 16 * 3  # both orders per prompt, minus identical-answer ties
    _assert_judgments_are_traces(client, runs["evaluate"], judgments)

    artifacts = {a.key: a for a in deployed.artifacts(flow_run_id)}
    assert artifacts["rlhf-summary"].type == "markdown"
    assert "policy_vs_sft" in artifacts["rlhf-summary"].data and parent.info.run_id in artifacts["rlhf-summary"].data
    assert artifacts["win-rates"].type == "table"

    # The version is registered from the train run's LoggedModel, which the register run used.
    version = client.get_model_version_by_alias("tiny-policy-pass", "candidate")
    assert version.run_id == runs["train"].info.run_id and version.source.startswith("models:/m-")
    model_id = version.source.removeprefix("models:/")
    assert [i.model_id for i in client.get_run(runs["register"].info.run_id).inputs.model_inputs] == [model_id]
    # The prompt sets are dataset inputs of the runs that read them.
    datasets = {s: {d.dataset.name for d in client.get_run(r.info.run_id).inputs.dataset_inputs} for s, r in runs.items()}
    assert datasets["train"] == {"train_prompts"} and datasets["evaluate"] == {"eval_prompts"}
    assert {d.dataset.name for d in client.get_run(parent.info.run_id).inputs.dataset_inputs} == {
        "train_prompts", "eval_prompts"}
    assert version.tags["sft_digest"] == parent.data.tags["rloo.sft_digest"] == parent.data.params["sft.digest"]
    # Issue 45: what the registry and the runs table show reads as a person would write it.
    flow_run_name = parent.data.tags["mlflow.runName"].rsplit("/", 1)[-1]
    assert {s: r.data.tags["mlflow.runName"] for s, r in runs.items()} == {s: f"{s}-{flow_run_name}" for s in runs}
    for rate in ("win_rate", "ci_low", "ci_high"):
        assert re.fullmatch(r"\d\.\d{4}", version.tags[f"policy_vs_sft.{rate}"]), version.tags
    assert re.search(r"CI \[\d\.\d{4}, \d\.\d{4}\]\.", version.description), version.description
    # One option reads the same in every run: JSON, as the parent's flattened config stores it.
    assert runs["reward"].data.params["reward.functions"] == parent.data.params["reward.functions"]
    assert runs["train"].data.params["train.bf16"] == parent.data.params["train.bf16"] == "false"


def test_gate_failure_records_why_and_registers_nothing(deployed):
    overrides = {"tracking.registered_model": "tiny-policy-fail", "tracking.promotion.min_ci_low": 1.0}
    flow_run_id, cli = deployed.run("rlhf-pipeline/on-demand", "--param", f"overrides={json.dumps(overrides)}")
    assert cli.returncode == 0, cli.stdout + cli.stderr + deployed.worker.log_tail(80)

    runs = deployed.mlflow_runs(flow_run_id)
    register = runs["register"]
    assert register.info.status == "FINISHED"
    assert register.data.tags["rloo.gate"] == "failed"
    assert "< min_ci_low 1.000" in register.data.tags["rloo.gate_reason"]
    assert register.data.metrics["gate/passed"] == 0.0
    client = deployed.services.mlflow()
    assert not client.search_registered_models(filter_string="name = 'tiny-policy-fail'")
    assert "not registered" in deployed.logs(flow_run_id)


def test_nightly_deployment_has_its_schedule_on_the_server(deployed):
    with deployed.services.prefect_settings(), deployed.client() as c:
        nightly = c.read_deployment_by_name("rlhf-pipeline/nightly")
        on_demand = c.read_deployment_by_name("rlhf-pipeline/on-demand")
        evaluate = c.read_deployment_by_name("evaluate-policy/on-demand")
    assert [s.schedule.cron for s in nightly.schedules] == ["0 2 * * *"]
    assert nightly.schedules[0].active
    assert not on_demand.schedules and not evaluate.schedules
    assert nightly.work_pool_name == "gpu-pool"
    assert nightly.parameters["cfg"]["train"]["num_generations"] == 4  # parameters come from the config file
    assert nightly.job_variables["env"]["MLFLOW_TRACKING_URI"] == deployed.services.mlflow_uri


def _assert_judgments_are_traces(client, eval_run, judgments: dict) -> None:
    """Each judged prompt reads back through MLflow's API as a trace of the evaluate run, with one verdict
    feedback per order and its score, whose mean per pairing is the run's win rate; the order
    disagreements are one tag filter away."""
    rows = [dict(zip(judgments["columns"], values, strict=True)) for values in judgments["data"]]
    by_prompt: dict[tuple, list[dict]] = {}
    for row in rows:
        by_prompt.setdefault((row["pairing"], row["prompt_id"]), []).append(row)
    disagreements = {k for k, rs in by_prompt.items() if len(rs) == 2 and rs[0]["winner"] != rs[1]["winner"]}
    where = {"locations": [eval_run.info.experiment_id], "run_id": eval_run.info.run_id, "max_results": 500}
    traces = client.search_traces(**where)
    assert eval_run.data.tags["evaluation.judgment_traces"] == str(len(by_prompt)) == str(len(traces)) == "48"
    scores: dict[str, list[float]] = {pairing: [] for pairing in PAIRINGS}
    for trace in traces:
        tags = trace.info.tags
        key = (tags["pairing"], tags["prompt_id"])
        feedback = {a.name: a for a in trace.info.assessments}
        model_a, model_b = by_prompt[key][0]["model_a"], by_prompt[key][0]["model_b"]
        scores[tags["pairing"]].append(feedback[f"{model_a}_wins_vs_{model_b}"].value)
        for row in by_prompt[key]:
            if row["order"]:
                assert feedback[f"verdict_{row['order']}"].value == row["winner"], key
                assert feedback[f"verdict_{row['order']}"].rationale == row["raw_verdict"], key
        assert tags["consistent"] == ("false" if key in disagreements else "true" if len(by_prompt[key]) == 2 else "n/a")
        assert trace.data.request is not None and row["prompt"] in trace.data.request
    for pairing, values in scores.items():
        assert eval_run.data.metrics[f"{pairing}/win_rate"] == pytest.approx(sum(values) / len(values)), pairing
    filtered = client.search_traces(**where, filter_string="tags.consistent = 'false'")
    assert {(t.info.tags["pairing"], t.info.tags["prompt_id"]) for t in filtered} == disagreements
