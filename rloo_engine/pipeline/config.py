"""PipelineConfig: the typed, validated parameter of the `rlhf-pipeline` and `evaluate-policy` flows.

It is the flow parameter, so Prefect validates it before a flow run starts any work: a bad value on
`prefect deployment run` fails the run at once, with the field named in the flow-run logs. The engine
options (`train`) use RLOOConfig's names and are checked by building the engine's own RLOOConfig, so
`num_generations: 1` fails here, not minutes later inside `accelerate launch`.

Secrets are never fields: the judge's API key and tokens are read at run time from a Prefect Secret
block or the worker's environment (`evaluation.api_key_secret`, `launch.secret_env`).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, Field, create_model, model_validator

from rloo_engine.config import RLOOConfig, build_config
from rloo_engine.config_base import ConfigError, F, StrictModel, import_paths, load_yaml, validated
from rloo_engine.evaluation.config import (
    EvalConfig,
    EvalGenerationConfig,
    JudgeConfig,
    PairingName,
    TokenPrice,
    build_eval_config,
)
from rloo_engine.pipeline.profiles import ACCELERATE_PROFILES, PROFILE_ENV

# RLOOConfig options the pipeline fills in from its other sections or its run directory.
PIPELINE_OWNED_ENGINE_FIELDS = {
    "model_name_or_path": "sft.source",
    "reward_model_name_or_path": "reward.model",
    "reward_funcs": "reward.functions",
    "reward_weights": "reward.weights",
    "dataset_name": "data.train_prompts",
    "dataset_config": "data.train_config",
    "dataset_train_split": "data.train_split",
    "output_dir": "output_root (each flow run writes under its own directory)",
    "run_name": "the flow run's name",
    "resume_from_checkpoint": "the flow run's directory (a Prefect retry resumes from its latest checkpoint)",
    "overwrite_output_dir": "the flow run's directory (each flow run writes its own; a retry resumes it)",
    "save_merged_model": "train.use_peft (a LoRA run also writes `final-merged/`: evaluation and the registry need a "
    "whole model)",
}


class SFTSection(StrictModel):
    """The SFT checkpoint RLOO starts from (and the baseline the policy is judged against)."""

    source: str = F(
        ...,
        "A local directory in `save_pretrained` format, a Hugging Face hub id, or an MLflow model URI "
        "(`models:/<name>@<alias>`, `models:/<name>/<version>`, `runs:/<run_id>/<path>`).",
        min_length=1,
    )
    revision: str | None = F(None, "Hub revision (branch, tag or commit) when `source` is a hub id.")


class RewardSection(StrictModel):
    """Where rewards come from: a reward model, reward functions, or both (weighted)."""

    model: str | None = F(
        None,
        "Reward model (`AutoModelForSequenceClassification`, num_labels=1): a local directory, hub id or MLflow "
        "model URI, like `sft.source`. It is probe-scored before training; NaN or constant scores are rejected.",
    )
    functions: Annotated[list[str], import_paths(
        "the training process `accelerate launch` starts reads its config from a file and cannot receive Python "
        "objects; give the function's import path 'module:function'")] = F(
        [], "Reward functions as `module:function` import paths; each is imported and probe-called before training."
    )
    weights: list[float] | None = F(
        None, "Weight of each source: the reward model first (if any), then each function. None = all 1.0."
    )
    probe_samples: int = F(
        8, "Prompt/completion pairs scored by the pre-training probe. More catches more degenerate models.", ge=2
    )

    @model_validator(mode="after")
    def _check(self) -> RewardSection:
        if not self.model and not self.functions:
            raise ValueError("reward: neither `model` nor `functions` is set; give a reward model or a reward function")
        return self


class DataSection(StrictModel):
    """Training prompts, evaluation prompts and reference completions."""

    train_prompts: str = F(
        ...,
        "Training prompt dataset (RLOOConfig `dataset_name`): a .jsonl/.json/.parquet/.csv file, a dataset "
        "directory or a hub id, with a `prompt` column.",
    )
    train_config: str | None = F(
        None, "Dataset configuration name of a hub training set (RLOOConfig `dataset_config`)."
    )
    train_split: str = F("train", "Split of the training set (RLOOConfig `dataset_train_split`).")
    eval_prompts: str = F(..., "Evaluation prompt set: a file, dataset directory or hub id, like `train_prompts`.")
    eval_split: str = F("test", "Split of the evaluation set (plain files have a single split).")
    prompt_column: str = F("prompt", "Column of the evaluation set holding the prompt.")
    reference_column: str | None = F(
        None, "Column of the evaluation set holding reference completions (e.g. human TL;DR summaries)."
    )
    reference_completions: str | None = F(
        None, "A completions JSONL file (`prompt` or `prompt_id`, and `completion`) used as the references instead."
    )


def _train_options_model() -> type[BaseModel]:
    """RLOOConfig's fields, minus those the pipeline owns, with the same names, types, defaults and docs."""
    fields = {
        name: (info.annotation, copy.deepcopy(info))
        for name, info in RLOOConfig.model_fields.items()
        if name not in PIPELINE_OWNED_ENGINE_FIELDS
    }
    return create_model(
        "TrainOptions",
        __base__=StrictModel,
        __doc__="Engine options, with RLOOConfig's names and meanings (see docs/configuration.md).",
        **fields,
    )


TrainOptions = _train_options_model()


# vllm-serve options the pipeline sets itself; in `extra_args` they would contradict what the trainer is told.
_SERVER_OWNED_ARGS = ("--model", "--host", "--port", "--weight-transfer-config", "--tensor-parallel-size")


class VLLMServerSection(StrictModel):
    """A vLLM server started beside the training group for `train.vllm_mode: server` (`rloo-engine vllm-serve`)."""

    enabled: bool = F(
        False,
        "Start a vLLM server for this training run, on this node, and give its URL to the engine. Needs "
        "`train.use_vllm: true` and `train.vllm_mode: server`. false = the engine uses `train.vllm_server_base_url`, "
        "a server someone else runs.",
    )
    devices: list[str] | None = F(
        None,
        "CUDA devices of the server (its `CUDA_VISIBLE_DEVICES`, as the worker's `CUDA_VISIBLE_DEVICES` names them, "
        "or indices 0..n-1 when that is unset); the training group gets the node's other devices. None = no split: "
        "both see every device (only sensible on CPU, or with `gpu_memory_utilization` leaving room for training; on "
        "a GPU the server then takes weights by CUDA IPC, `vllm-serve --shares_trainer_gpu`, as NCCL cannot).",
        min_length=1,
    )
    host: str = F(
        "127.0.0.1",
        "Address the server binds and the engine calls. Loopback: only this node's training processes need it.",
        min_length=1,
    )
    port: int | None = F(None, "Port of the server. None or 0 = a free port picked at start.", ge=0, le=65535)
    tensor_parallel_size: int | None = F(
        None, "vLLM tensor-parallel size. None = the number of `devices` (1 without devices).", ge=1
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] | None = F(
        None,
        "Weights dtype of the served model. None = `train.dtype`, so the server samples at the trainer's precision.",
    )
    gpu_memory_utilization: float | None = F(
        None, "Fraction of its GPUs' memory vLLM may take. None = vLLM's default (0.9).", gt=0.0, le=1.0
    )
    max_model_len: int | None = F(None, "vLLM's max_model_len. None = the model's (vLLM reads its config).", ge=1)
    extra_args: list[str] = F(
        [],
        "More arguments for vLLM's OpenAI server, passed after `--` unchanged (e.g. `[--max-num-seqs, '64']`). "
        f"{', '.join(_SERVER_OWNED_ARGS)} are set by the pipeline and rejected here.",
    )
    env: dict[str, str] = F(
        {},
        "Extra environment variables for the server only (e.g. VLLM_CPU_KVCACHE_SPACE, VLLM_LOGGING_LEVEL). "
        "Never put secrets here.",
    )
    placement: Literal["local", "node"] = F(
        "local",
        "`local`: beside training, on the train task's machine (rank 0's with several machines). `node`: on a "
        "machine of its own, as a run of `launch.nodes.deployment` (needs `num_machines > 1`); the training nodes "
        "get its URL and wait for its `/health`, and it is stopped when training ends. Set `host: 0.0.0.0` so the "
        "other machines reach it.",
    )
    startup_timeout_s: float = F(
        600.0,
        "Seconds to wait for the server's `/health` before failing the task (weights load and, on GPU, CUDA graphs "
        "are captured first). The error names the URL and ends with the server's last log lines.",
        gt=0.0,
    )

    @model_validator(mode="after")
    def _check(self) -> VLLMServerSection:
        for arg in self.extra_args:
            if arg.split("=", 1)[0] in _SERVER_OWNED_ARGS:
                raise ValueError(
                    f"extra_args: {arg!r} is set by the pipeline ({', '.join(_SERVER_OWNED_ARGS)}); use the section's "
                    "own options (host, port, tensor_parallel_size) instead"
                )
        if self.devices is not None and len(set(self.devices)) != len(self.devices):
            raise ValueError(f"devices: {self.devices} names a device twice; expected distinct CUDA devices")
        return self


class NodesSection(StrictModel):
    """Node runs of a multi-node launch: one run of a Prefect deployment per machine (`launch.num_machines > 1`)."""

    deployment: str = F(
        "train-node/node",
        "Deployment (`flow/deployment`) each machine runs (flows/train_node.py). Its work pool's workers are the "
        "nodes: one worker per machine, started with `--limit 1`, so two node runs never share a machine.",
        min_length=3,
        pattern=r"^[^/]+/[^/]+$",
    )
    job_variables: dict[str, Any] = F(
        {},
        "Job variables of every node run (e.g. `{image: ..., env: {...}}` for a Kubernetes pool), merged over the "
        "deployment's.",
    )
    start_timeout_s: float = F(
        600.0,
        "Seconds every node run may take to start and report its address (a worker must pick it up: a busy pool or "
        "a pending pod waits here). Past it the train task fails, naming the nodes that did not start. Rank 0's "
        "rendezvous waits this long plus 300 s for the others (`--rdzv_conf timeout=`), so a node that starts late "
        "within it still joins.",
        gt=0.0,
    )
    poll_interval_s: float = F(
        2.0, "How often the train task reads the node runs' states; a node's failure is noticed within it.", gt=0.0
    )
    cancel_timeout_s: float = F(
        120.0,
        "After one node fails, seconds to wait for the others to be cancelled (their workers kill their process "
        "groups) before the task fails anyway.",
        gt=0.0,
    )


class LaunchSection(StrictModel):
    """How the training process is launched: `accelerate launch` with a profile from deployments/accelerate/."""

    profile: str | None = F(
        None,
        f"Accelerate config: one of {', '.join(ACCELERATE_PROFILES)} (deployments/accelerate/<profile>.yaml) or "
        f"the path of an accelerate YAML file. None = the `{PROFILE_ENV}` environment variable (a job variable of "
        "the work pool or deployment), else `single_gpu` when CUDA is available and `cpu` otherwise.",
    )
    num_processes: int | None = F(
        None, "Processes over all machines (`--num_processes`). None = the profile's value.", ge=1
    )
    num_machines: int = F(
        1,
        "Machines training together (`--num_machines`). Above 1 the train task starts one `launch.nodes.deployment` "
        "run per machine, each with its `--machine_rank`, and waits for all of them (docs/pipeline.md, Multi-node).",
        ge=1,
    )
    main_process_port: int | None = F(
        None,
        "Port of rank 0 (`--main_process_port`). None = on one machine the profile's, else a free one (accelerate's "
        "default 29500 collides when two runs start together); on several, a free port rank 0's node picks.",
        ge=1,
        le=65535,
    )
    env: dict[str, str] = F(
        {}, "Extra environment variables for the training process only (e.g. NCCL_*). Never put secrets here."
    )
    secret_env: dict[str, str] = F(
        {},
        "Environment variables for the training process read from Prefect Secret blocks at run time: "
        "{ENV_VAR: secret-block-name}, e.g. {HF_TOKEN: hf-token}. The values are never parameters or logged.",
    )
    retries: int = F(
        1, "Prefect retries of the training task. A retry resumes from the latest checkpoint of the same run.", ge=0
    )
    retry_delay_seconds: float = F(10.0, "Wait before a retry (lets a crashed node release its GPUs).", ge=0.0)
    crash_reruns: int = F(
        2,
        "How often a crashed flow run (its process or worker killed) may run again, rescheduled by the automation "
        "deployments/automations/rerun-crashed-flow-runs.yaml: it resumes in its own output directory. One more "
        "crash after these ends it Failed, naming this option.",
        ge=0,
    )
    timeout_seconds: float | None = F(
        None,
        "Kill training (the whole process group) after this many seconds and fail the task. None = no limit.",
        gt=0.0,
    )
    log_interval_seconds: float = F(
        10.0,
        "At most one line of training output per this many seconds goes to the Prefect logs (errors and "
        "tracebacks always do); the full output is in the `train.log` artifact.",
        ge=0.0,
    )
    kill_grace_seconds: float = F(
        10.0, "On cancellation or failure, SIGTERM the process group, wait this long, then SIGKILL it.", ge=0.0
    )
    gpu_concurrency_limit: str | None = F(
        None,
        "Name of a Prefect global concurrency limit held while training (one slot), e.g. `gpu-node-{hostname}` with "
        "limit 1 keeps one GPU job per node. `{hostname}` is replaced by the worker's host name. None = no limit "
        "(rely on `prefect worker start --limit 1` per node instead).",
    )
    vllm_server: VLLMServerSection = Field(
        default_factory=VLLMServerSection,
        description="A vLLM server started beside training for `train.vllm_mode: server` (see docs/pipeline.md).",
    )
    nodes: NodesSection = Field(
        default_factory=NodesSection,
        description="How the machines of a multi-node run are started and watched (`num_machines > 1`).",
    )

    @model_validator(mode="before")
    @classmethod
    def _refuse_node_fields(cls, values: Any) -> Any:
        for name in ("machine_rank", "main_process_ip"):
            if isinstance(values, dict) and name in values:
                raise ValueError(
                    f"{name}: {values[name]!r} is set by the pipeline: with num_machines > 1 the train task starts one "
                    "node run per machine with its rank, and rank 0's node reports its address; remove it"
                )
        return values

    @model_validator(mode="after")
    def _check_nodes(self) -> LaunchSection:
        if self.num_machines > 1 and self.num_processes is None:
            raise ValueError(
                f"num_processes: required with num_machines: {self.num_machines} (the processes of every machine "
                "together, e.g. 16 for 2 machines of 8 GPUs); each node's profile cannot be read from here"
            )
        if self.num_processes is not None and self.num_processes % self.num_machines:
            raise ValueError(
                f"num_processes: {self.num_processes} does not divide over num_machines: {self.num_machines}; "
                "expected a multiple (it counts the processes of every machine together)"
            )
        if self.vllm_server.placement == "node" and self.num_machines == 1:
            raise ValueError(
                "vllm_server.placement: 'node' needs num_machines > 1 (a node run of its own); on one machine use "
                "placement: local"
            )
        return self


# EvaluationSection fields that are not EvalConfig's: every other field is passed on under its own name.
_PIPELINE_ONLY_EVAL_FIELDS = ("num_samples", "api_key_secret", "trace_judgments")


def _eval_field(name: str) -> Any:
    """EvalConfig's field `name` (default, constraints, description), so the two never drift apart."""
    return copy.deepcopy(EvalConfig.model_fields[name])


class EvaluationSection(StrictModel):
    """The judge evaluation: which judge, which pairings, how many prompts. See docs/evaluation.md."""

    judge: JudgeConfig = F(..., "The judge and how it is called (required: no paid API is ever picked by default).")
    pairings: list[PairingName] | None = F(
        None,
        "Comparisons: policy_vs_reference, sft_vs_reference, policy_vs_sft. None = all whose sides are available. "
        "The promotion gate needs policy_vs_sft.",
    )
    num_samples: int | None = F(None, "Evaluate the first this many eval prompts. None = all.", ge=1)
    trace_judgments: int = F(
        1000,
        "Record up to this many judged prompts (all pairings together) as MLflow traces of the evaluate run, each "
        "with its score for model_a (`policy_wins_vs_sft` ...: 1 / 0.5 / 0, averaging to the win rate) and each "
        "order's verdict and judge reply as feedback. Above the cap, a uniform random sample (seeded by `seed`, "
        "each pairing in proportion), so the UI's averages stay unbiased; every judgment, failures and "
        "disagreements included, is in the judgments table artifact, which is always logged. 0 = no traces.",
        ge=0,
    )
    order_mode: Literal["both", "single"] = _eval_field("order_mode")
    both_orders_rule: Literal["agree", "average"] = _eval_field("both_orders_rule")
    reference_answer_column: str | None = _eval_field("reference_answer_column")
    generation: EvalGenerationConfig = Field(
        default_factory=EvalGenerationConfig,
        description="How policy and SFT completions are generated (greedy by default).",
    )
    max_failed_fraction: float = _eval_field("max_failed_fraction")
    min_consistency: float = _eval_field("min_consistency")
    max_first_slot_deviation: float = _eval_field("max_first_slot_deviation")
    lc_min_overlap: float = _eval_field("lc_min_overlap")
    lc_warning_threshold: float = _eval_field("lc_warning_threshold")
    bootstrap_resamples: int = _eval_field("bootstrap_resamples")
    confidence_level: float = _eval_field("confidence_level")
    seed: int = _eval_field("seed")
    prices: dict[str, TokenPrice] = _eval_field("prices")
    budget_usd: float | None = _eval_field("budget_usd")
    cache_path: str | None = F(
        None, "Shared SQLite judgment cache. None = one cache per flow run, in its evaluation directory."
    )
    progress: bool = F(
        False, "Progress bars for generation and judging on the flow process's stderr (off: worker logs stay readable)."
    )
    api_key_secret: str | None = F(
        None,
        "Name of a Prefect Secret block holding the judge's API key. It is read at run time and exposed as "
        "`judge.api_key_env` to the evaluation only. None = the worker's environment must already have it.",
    )


class PromotionGate(StrictModel):
    """When a trained policy becomes a registry candidate."""

    min_ci_low: float = F(
        0.5,
        "Register the policy only when the lower bound of the policy-vs-SFT win-rate CI (of the rate `rate` "
        "names) reaches this value. 0.5 means: better than SFT with the configured confidence.",
        ge=0.0,
        le=1.0,
    )
    rate: Literal["length_controlled", "style_controlled", "raw"] = F(
        "length_controlled",
        "Which policy-vs-SFT rate the gate reads. `length_controlled`: the rate at equal length (a policy whose "
        "only gain is longer answers, the classic way an RL policy games a judge, does not pass). "
        "`style_controlled`: at equal length and equal markdown (headers, lists, bold), after Arena-Hard. "
        "`raw`: the plain win rate, whatever the judge rewards.",
    )
    allow_unadjusted: bool = F(
        False,
        "When the controlled rate is not estimable (the policy is longer, or more styled, on nearly every "
        "prompt, so equal length lies outside the data), gate on the raw rate instead of refusing. The reason "
        "then says so.",
    )
    min_n: int = F(
        50,
        "Refuse promotion when policy_vs_sft has fewer valid prompts than this, whatever its interval: a few "
        "prompts say little about a policy even when every one is won.",
        ge=1,
    )
    alias: str = F("candidate", "Registry alias moved to the new version when the gate passes.", min_length=1)


class TrackingSection(StrictModel):
    """MLflow experiment and registry."""

    tracking_uri: str | None = F(
        None,
        "MLflow tracking server, e.g. http://mlflow.internal:5000. None = the MLFLOW_TRACKING_URI environment "
        "variable (a job variable of the work pool); one of the two must be set.",
    )
    experiment: str = F("rlhf-pipeline", "MLflow experiment holding one parent run per flow run.", min_length=1)
    registered_model: str = F(
        "rloo-policy", "Model Registry name the promoted policy is registered under.", min_length=1
    )
    promotion: PromotionGate = Field(default_factory=PromotionGate, description="The promotion gate.")


class PipelineConfig(StrictModel):
    """All options of one pipeline run: ingest -> reward -> train -> evaluate -> register."""

    sft: SFTSection
    reward: RewardSection
    data: DataSection
    train: TrainOptions = Field(  # type: ignore[valid-type]
        default_factory=TrainOptions,
        description="Engine options (RLOOConfig names); the engine's own validation applies.",
    )
    launch: LaunchSection = Field(default_factory=LaunchSection, description="How training is launched.")
    evaluation: EvaluationSection
    tracking: TrackingSection = Field(
        default_factory=TrackingSection, description="MLflow experiment, registry and promotion gate."
    )
    output_root: str = F(
        "outputs/pipeline",
        "Root of run outputs; each flow run writes to `<output_root>/<flow-run-id>/`, so concurrent runs never "
        "share files. Use shared storage when workers on several nodes must see each other's checkpoints.",
        min_length=1,
    )

    @model_validator(mode="after")
    def _check_vllm_server(self) -> PipelineConfig:
        server_mode = self.train.use_vllm and self.train.vllm_mode == "server"
        # Not `model_fields_set`: a config that went through Prefect or `overrides` has every field set.
        defaults = TrainOptions.model_fields
        given_url = self.train.vllm_server_base_url is not None or any(
            getattr(self.train, name) != defaults[name].default for name in ("vllm_server_host", "vllm_server_port")
        )
        if self.launch.vllm_server.enabled:
            if not server_mode:
                raise ValueError(
                    f"launch.vllm_server.enabled: true, but train.use_vllm: {self.train.use_vllm} and "
                    f"train.vllm_mode: {self.train.vllm_mode!r}; the server is only used with use_vllm: true and "
                    "vllm_mode: server"
                )
            if given_url:
                raise ValueError(
                    "launch.vllm_server.enabled: true and train.vllm_server_base_url/host/port are both set; either "
                    "start a server beside training or use the one at that URL, not both"
                )
        elif server_mode and not given_url:
            raise ValueError(
                "train.vllm_mode: 'server' without a server: set launch.vllm_server.enabled: true to start one beside "
                "training, or train.vllm_server_base_url to the URL of a running `rloo-engine vllm-serve`"
            )
        return self

    @model_validator(mode="after")
    def _check_engine_and_eval(self) -> PipelineConfig:
        # Placeholders stand for what the run resolves later (downloaded checkpoints, the run directory);
        # the engine's and the evaluation's own cross-field rules are checked here, before any work. The
        # model placeholders are hub-id shaped so the engine's path check leaves them alone: whether
        # sft.source / reward.model exist is checked on the worker, by ingest, before anything is loaded.
        try:
            self.engine_config(
                sft_path="resolved-at-run-time/sft",
                reward_model_path="resolved-at-run-time/reward-model" if self.reward.model else None,
                output_dir="<run>/train",
                run_name="<run>",
            )
        except ConfigError as err:
            raise ValueError(str(err)) from None
        try:
            self.eval_config(output_dir="<run>/eval")
        except ConfigError as err:
            raise ValueError(str(err)) from None
        return self

    # ------------------------------------------------------------------ derived configs
    def engine_config(
        self,
        *,
        sft_path: str,
        reward_model_path: str | None,
        output_dir: str,
        run_name: str,
        vllm_server_url: str | None = None,
    ) -> RLOOConfig:
        """The engine's RLOOConfig for this run: `train` plus the resolved model paths and the run's directory
        (and the URL of the vLLM server the task started, if it started one)."""
        values = self.train.model_dump()
        # The train stage run's metrics and the registered model's source run are MLflow's, whatever else is asked.
        if not {"all", "mlflow"} & set(self.train.report_to):
            values["report_to"] = ["mlflow", *self.train.report_to]
        values["save_merged_model"] = self.train.use_peft
        if vllm_server_url is not None:
            values["vllm_server_base_url"] = vllm_server_url
        values.update(
            model_name_or_path=sft_path,
            reward_model_name_or_path=reward_model_path,
            reward_funcs=list(self.reward.functions),
            reward_weights=self.reward.weights,
            dataset_name=self.data.train_prompts,
            dataset_config=self.data.train_config,
            dataset_train_split=self.data.train_split,
            output_dir=output_dir,
            run_name=run_name,
            resume_from_checkpoint="latest",
        )
        return build_config(values, source="PipelineConfig.train")

    def eval_config(self, *, output_dir: str) -> EvalConfig:
        """The evaluation library's EvalConfig; policy and SFT paths are passed to `run_evaluation` separately."""
        e = self.evaluation
        values = e.model_dump(exclude=set(_PIPELINE_ONLY_EVAL_FIELDS))
        values.update(
            prompts=self.data.eval_prompts,
            split=self.data.eval_split,
            prompt_column=self.data.prompt_column,
            reference_column=self.data.reference_column,
            reference_completions=self.data.reference_completions,
            max_prompts=e.num_samples,
            output_dir=output_dir,
        )
        return build_eval_config(values, source="PipelineConfig.evaluation")

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_yaml(cls, path: str | Path, overrides: dict[str, Any] | None = None) -> PipelineConfig:
        """Reads a YAML config; `overrides` are dotted keys (`train.learning_rate: 1e-5`) applied on top."""
        return build_pipeline_config(load_yaml(path), overrides, source=str(path))

    def with_overrides(self, overrides: dict[str, Any] | None) -> PipelineConfig:
        """A validated copy with dotted-key overrides applied (the flows' `overrides` parameter)."""
        if not overrides:
            return self
        return build_pipeline_config(self.model_dump(mode="json"), overrides, source="overrides")

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


def build_pipeline_config(
    values: dict[str, Any], overrides: dict[str, Any] | None = None, source: str = "PipelineConfig"
) -> PipelineConfig:
    """Validates `values` (plus dotted-key `overrides`) into a PipelineConfig; ConfigError names every bad field."""
    merged = copy.deepcopy(values)
    for dotted, value in (overrides or {}).items():
        _set_dotted(merged, dotted, value, source)
    return validated(PipelineConfig, merged, source)


def _set_dotted(values: dict[str, Any], dotted: str, value: Any, source: str) -> None:
    node = values
    parts = dotted.split(".")
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{source}: {dotted}: {'.'.join(parts[: i + 1])} is a value, not a section")
        node = child
    node[parts[-1]] = value


# EvalConfig field -> the PipelineConfig field it comes from, so errors name what the user wrote.
_PIPELINE_FIELDS = {
    "prompts": "data.eval_prompts",
    "prompt_column": "data.prompt_column",
    "reference_column": "data.reference_column",
    "reference_completions": "data.reference_completions",
    "judge.": "evaluation.judge.",
}


def pipeline_field_names(message: str) -> str:
    """An evaluation-library error about `prompts`, `judge.model`, ... renamed to the PipelineConfig field it came from."""
    for eval_name, pipeline_name in _PIPELINE_FIELDS.items():
        if message.startswith(eval_name):
            return pipeline_name + message[len(eval_name) :]
    return message
