"""The pipeline's train stage under `launch.profile: deepspeed_zero3`, two CPU processes, through a real worker."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def test_train_stage_runs_the_zero3_profile_with_two_processes(deployed):
    overrides = {
        "launch.profile": "deepspeed_zero3",
        "launch.num_processes": 2,  # the profile says 8 (a GPU node); the launcher passes --num_processes
        "launch.env": {"DS_ACCELERATOR": "cpu"},
        "train.per_device_train_batch_size": 8,  # each rank's 8 completions are 2 groups of G=4
        "train.max_steps": 4,
        "train.save_steps": 2,
        "tracking.registered_model": "tiny-policy-zero3",
    }
    flow_run_id, cli = deployed.run("rlhf-pipeline/on-demand", "--param", f"overrides={json.dumps(overrides)}")
    assert cli.returncode == 0, cli.stdout + cli.stderr + deployed.worker.log_tail(80)
    assert deployed.flow_run(flow_run_id).state.name == "Completed"
    runs = deployed.mlflow_runs(flow_run_id)
    train = runs["train"]
    assert train.data.params["launch.profile"] == "deepspeed_zero3"
    client = deployed.services.mlflow()
    assert [m.step for m in client.get_metric_history(train.info.run_id, "reward")] == [2, 4]
    assert "deepspeed_zero3.yaml --num_processes 2" in deployed.logs(flow_run_id)
    # Both ranks trained under DeepSpeed: checkpoint-2 holds a ZeRO-3 shard of each.
    shards = {p.name for p in Path(deployed.config["output_root"]).rglob("checkpoint-2/**/*zero_pp_rank*")}
    assert {"zero_pp_rank_0_mp_rank_00_model_states.pt", "zero_pp_rank_1_mp_rank_00_model_states.pt"} <= shards
