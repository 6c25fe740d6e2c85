"""PipelineConfig: loading, engine-level validation up front, overrides, stable param names, shipped configs."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from rloo_engine.config_base import ConfigError
from rloo_engine.pipeline.config import (
    PIPELINE_OWNED_ENGINE_FIELDS,
    LaunchSection,
    PipelineConfig,
    TrainOptions,
    build_pipeline_config,
)
from rloo_engine.pipeline.profiles import resolve_profile
from rloo_engine.pipeline.tracking import flat_params
from tests.pipeline.pipeline_helpers import REPO_ROOT, tiny_pipeline_config

ASSETS = {
    "sft": Path("/models/sft"),
    "reward_model": Path("/models/rm"),
    "train_prompts": Path("/data/train.jsonl"),
    "eval_prompts": Path("/data/eval.jsonl"),
}


def config(**changes) -> dict:
    values = tiny_pipeline_config(ASSETS, Path("/runs"))
    for dotted, value in changes.items():
        section, key = dotted.split("__")
        values[section][key] = value
    return values


def test_tiny_config_validates_and_builds_the_engine_config():
    cfg = build_pipeline_config(config())
    engine = cfg.engine_config(
        sft_path="org/sft", reward_model_path="org/rm", output_dir="/runs/1/train", run_name="r"
    )
    assert engine.model_name_or_path == "org/sft"
    assert engine.reward_model_name_or_path == "org/rm"
    assert engine.reward_funcs == ["rloo_engine.reward_functions:char_fraction"]
    assert engine.dataset_name == "/data/train.jsonl"
    assert engine.output_dir == "/runs/1/train"
    assert engine.resume_from_checkpoint == "latest"  # what makes a Prefect retry resume
    assert engine.num_generations == 4 and engine.learning_rate == 3e-3


def test_num_generations_1_is_rejected_with_the_field_named():
    with pytest.raises(ConfigError, match=r"PipelineConfig.train: num_generations: 1; RLOO needs at least 2"):
        build_pipeline_config(config(train__num_generations=1))


def test_cross_section_engine_rules_are_checked_up_front():
    # Two reward sources (model + one function) but three weights: the engine's own rule, named.
    with pytest.raises(ConfigError, match=r"reward_weights: \[1.0, 1.0, 1.0\] has 3 entries; expected 2"):
        build_pipeline_config(config(reward__weights=[1.0, 1.0, 1.0]))


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"train__num_generationz": 4}, "train.num_generationz: unknown option"),
        ({"train__learning_rate": -1.0}, "train.learning_rate: Input should be greater than 0"),
        ({"train__output_dir": "/elsewhere"}, "train.output_dir: unknown option"),
        ({"reward__model": None, "reward__functions": []}, "neither `model` nor `functions` is set"),
        (
            {"evaluation__judge": {"backend": "python"}},
            "PipelineConfig: evaluation.judge.function: None; the python judge needs an import path",
        ),
        ({"launch__num_processes": 0}, "launch.num_processes: Input should be greater than or equal to 1"),
    ],
)
def test_invalid_values_name_their_field(changes, message):
    with pytest.raises(ConfigError) as err:
        build_pipeline_config(config(**changes))
    assert message in str(err.value)


def test_pipeline_owned_engine_options_are_not_train_options():
    assert not set(PIPELINE_OWNED_ENGINE_FIELDS) & set(TrainOptions.model_fields)
    # Every other engine option is a train option, with its documentation.
    assert TrainOptions.model_fields["beta"].description.startswith("KL coefficient")


def test_overrides_are_dotted_keys_and_validated():
    cfg = build_pipeline_config(config())
    changed = cfg.with_overrides({"train.learning_rate": 1e-5, "launch.env": {"NCCL_DEBUG": "INFO"}})
    assert changed.train.learning_rate == 1e-5 and changed.launch.env == {"NCCL_DEBUG": "INFO"}
    assert cfg.train.learning_rate == 3e-3  # the original is untouched
    with pytest.raises(ConfigError, match="overrides: PipelineConfig.train: num_generations: 1"):
        cfg.with_overrides({"train.num_generations": 1})
    with pytest.raises(ConfigError, match="tracking.promotoin: unknown option"):
        cfg.with_overrides({"tracking.promotoin.alias": "x"})


def test_params_have_stable_dotted_names_and_json_values():
    params = flat_params(build_pipeline_config(config()).model_dump(mode="json"))
    assert params["train.learning_rate"] == "0.003"
    assert params["train.log_completions"] == "true"
    assert params["train.reward_clip_range"] == "null"
    assert params["evaluation.judge.backend"] == "python"
    assert params["reward.functions"] == '["rloo_engine.reward_functions:char_fraction"]'
    assert params["tracking.promotion.min_ci_low"] == "0.0"


def test_flow_parameter_schema_holds_no_secret_values():
    from prefect.utilities.callables import parameter_schema

    from flows.rlhf_pipeline import rlhf_pipeline

    text = yaml.safe_dump(parameter_schema(rlhf_pipeline).model_dump())
    # Secrets are referenced by name (env var, Prefect Secret block), never carried as values.
    assert "api_key_env" in text and "api_key_secret" in text
    assert "api_key:" not in text and "token:" not in text and "password" not in text


def test_shipped_example_config_and_prefect_yaml_are_valid():
    example = PipelineConfig.from_yaml(REPO_ROOT / "configs" / "pipeline_example.yaml")
    assert example.evaluation.judge.backend == "openai" and example.evaluation.api_key_secret == "openai-api-key"
    spec = yaml.safe_load((REPO_ROOT / "deployments" / "prefect.yaml").read_text())
    names = {(d["entrypoint"], d["name"]) for d in spec["deployments"]}
    assert names == {
        ("flows/rlhf_pipeline.py:rlhf_pipeline", "nightly"),
        ("flows/rlhf_pipeline.py:rlhf_pipeline", "on-demand"),
        ("flows/evaluate_policy.py:evaluate_policy", "on-demand"),
        ("flows/train_node.py:train_node", "node"),
    }
    # The node runs of multi-node training (launch.nodes.deployment's default) go to the nodes' own pool.
    assert LaunchSection().nodes.deployment == "train-node/node"
    for d in spec["deployments"]:
        assert d["work_pool"]["name"] == ("train-nodes" if d["name"] == "node" else "gpu-pool")
        assert {"MLFLOW_TRACKING_URI", "RLOO_ACCELERATE_PROFILE"} <= set(d["work_pool"]["job_variables"]["env"])
    nightly = next(d for d in spec["deployments"] if d["name"] == "nightly")
    assert nightly["schedules"][0]["cron"] == "0 2 * * *"


@pytest.mark.parametrize("profile", ["cpu", "single_gpu", "multi_gpu", "deepspeed_zero2", "deepspeed_zero3", "fsdp2"])
def test_accelerate_profiles_load(profile):
    from accelerate.commands.config.config_args import load_config_from_file

    path = resolve_profile(profile, {})
    assert path == REPO_ROOT / "deployments" / "accelerate" / f"{profile}.yaml"
    assert load_config_from_file(str(path)).compute_environment.value == "LOCAL_MACHINE"


def test_profile_comes_from_config_then_job_variable():
    assert resolve_profile("cpu", {"RLOO_ACCELERATE_PROFILE": "multi_gpu"}).name == "cpu.yaml"
    assert resolve_profile(None, {"RLOO_ACCELERATE_PROFILE": "multi_gpu"}).name == "multi_gpu.yaml"
    with pytest.raises(ConfigError, match=r"launch.profile: 'tpu' is neither one of cpu, single_gpu"):
        resolve_profile("tpu", {})
    with pytest.raises(ConfigError, match=r"\$RLOO_ACCELERATE_PROFILE: 'gpu'"):
        resolve_profile(None, {"RLOO_ACCELERATE_PROFILE": "gpu"})


SERVER_MODE = {"use_vllm": True, "vllm_mode": "server"}


def config_with(train: dict, vllm_server: dict | None = None) -> dict:
    values = config()
    values["train"].update(train)
    if vllm_server is not None:
        values["launch"]["vllm_server"] = vllm_server
    return values


@pytest.mark.parametrize(
    ("train", "vllm_server", "message"),
    [
        (SERVER_MODE, None, "train.vllm_mode: 'server' without a server: set launch.vllm_server.enabled: true"),
        ({}, {"enabled": True}, "launch.vllm_server.enabled: true, but train.use_vllm: False"),
        ({"use_vllm": True}, {"enabled": True}, "train.vllm_mode: 'colocate'; the server is only used with"),
        ({**SERVER_MODE, "vllm_server_base_url": "http://10.0.0.5:8000"}, {"enabled": True}, "not both"),
        (SERVER_MODE, {"enabled": True, "extra_args": ["--port=9000"]}, "extra_args: '--port=9000' is set by the"),
        (SERVER_MODE, {"enabled": True, "devices": ["0", "0"]}, "devices: ['0', '0'] names a device twice"),
    ],
)
def test_bad_vllm_server_combinations_are_config_errors(train, vllm_server, message):
    with pytest.raises(ConfigError) as err:
        build_pipeline_config(config_with(train, vllm_server))
    assert message in str(err.value)


def test_vllm_server_mode_takes_a_started_server_or_a_given_url():
    started = build_pipeline_config(config_with(SERVER_MODE, {"enabled": True}))
    engine = started.engine_config(sft_path="org/sft", reward_model_path="org/rm", output_dir="/o", run_name="r",
                                   vllm_server_url="http://127.0.0.1:4321")
    assert engine.vllm_server_url == "http://127.0.0.1:4321"
    # survives the round trip through Prefect's JSON parameters and `overrides`
    assert started.with_overrides({"train.max_steps": 3}).launch.vllm_server.enabled
    given = build_pipeline_config(config_with({**SERVER_MODE, "vllm_server_base_url": "http://10.0.0.5:8000"}))
    given = given.with_overrides({"train.max_steps": 3})
    assert given.engine_config(sft_path="org/sft", reward_model_path="org/rm", output_dir="/o",
                               run_name="r").vllm_server_url == "http://10.0.0.5:8000"
