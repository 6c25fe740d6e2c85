"""Every field `trl rloo` accepts (TRL 1.16), classified for `rloo-engine train`: same, different, ignored or refused.

`trl rloo` parses four dataclasses: its script arguments (`ScriptArguments` plus the reward model and functions),
`RLOOConfig` (with every field of transformers' `TrainingArguments`), `ModelConfig` and `DatasetMixtureConfig`.
This table is the one place that says what each of those fields does here:

- `same`: an RLOOConfig field (or a command-line setting) with TRL's name and meaning;
- `different`: implemented, but not exactly as TRL does it; the note says how and why;
- `ignored`: accepted, with no effect, and named on stderr; only where TRL's own RLOO run does not use it either,
  or where it cannot change what is trained;
- `refused`: a configuration error naming the reason and what to do instead, unless the value given is TRL's
  default (which asks for nothing), so a YAML file that spells out TRL's defaults still loads.

The command line (`rloo_engine/cli.py`), the `--config` YAML loader and docs/configuration.md use it;
tests/engine/test_trl_parity.py fails on a TRL field missing here and compares TRL's own parser with ours.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Literal

Kind = Literal["same", "different", "ignored", "refused"]
_NO_DEFAULT = object()


@dataclass(frozen=True)
class TrlField:
    kind: Kind
    note: str = ""
    ours: str | None = None  # our RLOOConfig field when its name differs from TRL's
    trl_default: Any = _NO_DEFAULT  # refused fields: TRL's default, accepted as a no-op


def _same(note: str = "", ours: str | None = None) -> TrlField:
    return TrlField("same", note, ours)


def _different(note: str, ours: str | None = None) -> TrlField:
    return TrlField("different", note, ours)


def _ignored(note: str) -> TrlField:
    return TrlField("ignored", note)


def _refused(note: str, trl_default: Any) -> TrlField:
    return TrlField("refused", note, trl_default=trl_default)


_EVAL_SHAPE = "evaluation generates, scores and logs each eval batch itself (`eval_during_training.py`)"
_AS_TRL_RLOO = "TRL's RLOOTrainer does not use it either"
_HUB = "pushing to the Hugging Face Hub; register the model with the pipeline's MLflow stage, or upload `final/` yourself"
_DATALOADER = "the prompt loader is a plain in-process iterator over a small prompt set, with no worker processes"

# FSDP is chosen by the launch, as accelerate's own FSDP path is (not by a training argument, as transformers' Trainer).
_FSDP_BY_PROFILE = ("FSDP2 comes from the launch profile: `accelerate launch --config_file deployments/accelerate/fsdp2.yaml "
                    "...` (README, Running on GPUs)")
TRL_FIELDS: dict[str, TrlField] = {
    # ------------------------------------------------------------ script arguments (`trl rloo`'s own)
    "dataset_name": _same("also a local .jsonl/.json/.parquet/.csv file or dataset directory"),
    "dataset_config": _same(),
    "dataset_train_split": _same(),
    "dataset_test_split": _same("a single data file has no such split: refused, naming the file"),
    "dataset_streaming": _refused("prompts are loaded whole (a prompt set is small); drop the option", False),
    "ignore_bias_buffers": _refused(
        "a DDP workaround for boolean buffers that TRL's RLOO script does not apply either; drop the option", False),
    "reward_model_name_or_path": _same(),
    "reward_funcs": _different(
        "import paths: TRL's dotted `pkg.module.func` is read as `pkg.module:func`; TRL's built-in names "
        "(`accuracy_reward`, `think_format_reward`, ...) need TRL installed: give `trl.rewards:accuracy_reward`"),
    # ------------------------------------------------------------ RLOOConfig: TrainingArguments
    "output_dir": _different("default `outputs/rloo` (TRL: `trainer_output`); the run's last lines name where "
                             "everything went"),
    "per_device_train_batch_size": _same("completions, not prompts"),
    "num_train_epochs": _same(),
    "max_steps": _same(),
    "learning_rate": _same(),
    "lr_scheduler_type": _same(),
    "lr_scheduler_kwargs": _same(),
    "warmup_steps": _different("a value below 1 is a fraction of the total steps, as in TRL, and is stored as "
                               "`warmup_ratio`; 1 and above are whole steps"),
    "optim": _different("the optimizers this engine builds (`rloo_engine/config.py`, `optim`); any other name is a "
                        "configuration error naming the choices"),
    "optim_args": _refused("optimizer settings go in `adam_beta1`, `adam_beta2`, `adam_epsilon`, `weight_decay`", None),
    "weight_decay": _same(),
    "adam_beta1": _same(),
    "adam_beta2": _same(),
    "adam_epsilon": _same(),
    "optim_target_modules": _refused("only for GaLore/APOLLO optimizers, which are not built here", None),
    "gradient_accumulation_steps": _same(),
    "average_tokens_across_devices": _ignored(
        f"the RLOO loss is a mean over completions, not a token-weighted sum; {_AS_TRL_RLOO}"),
    "max_grad_norm": _same("0 or null turns clipping off"),
    "label_smoothing_factor": _ignored(f"there are no labels in RLOO; {_AS_TRL_RLOO}"),
    "bf16": _different(
        "default false here (TRL: true). TRL's true fails on a machine without bf16 support unless `--use_cpu`; "
        "false lets one config run on CPU and GPU alike and keeps the float32 fast paths (decode-time log-probs, "
        "fused decode). Pass `--bf16` for TRL's run on a GPU; the difference is printed at start."),
    "fp16": _same(),
    "bf16_full_eval": _ignored("evaluation runs in the training precision (`bf16`/`fp16`, `dtype`)"),
    "fp16_full_eval": _ignored("evaluation runs in the training precision (`bf16`/`fp16`, `dtype`)"),
    "tf32": _same(),
    "activation_checkpointing": _same("transformers' new name of `gradient_checkpointing`", ours="gradient_checkpointing"),
    "activation_checkpointing_kwargs": _same("transformers' new name of `gradient_checkpointing_kwargs`",
                                             ours="gradient_checkpointing_kwargs"),
    "gradient_checkpointing": _different(
        "default false here (TRL: true): it recomputes activations (~20-30% slower) and turns off the shared-prompt "
        "training forward; the gradients are the same. Pass `--gradient_checkpointing` for TRL's memory trade; the "
        "difference is printed at start."),
    "gradient_checkpointing_kwargs": _same(),
    "torch_compile": _refused("models run eagerly here; drop the option", False),
    "torch_compile_backend": _refused("models run eagerly here (no torch_compile); drop the option", None),
    "torch_compile_mode": _refused("models run eagerly here (no torch_compile); drop the option", None),
    "use_liger_kernel": _same(),
    "liger_kernel_config": _refused("Liger kernels run with their defaults (`use_liger_kernel`)", None),
    "use_cache": _ignored("generation always uses a KV cache and the training forward never keeps one; there is "
                          "nothing to switch"),
    "neftune_noise_alpha": _refused("NEFTune embedding noise is an SFT technique, not built here", None),
    "torch_empty_cache_steps": _refused(
        "not built; memory levers here are `gradient_checkpointing`, `chunked_logprobs`, `vllm_enable_sleep_mode`",
        None),
    "auto_find_batch_size": _refused("set `per_device_train_batch_size` (and `gradient_accumulation_steps`)", False),
    "logging_strategy": _refused("metrics are written every `logging_steps` optimizer steps, TRL's default `steps`",
                                 "steps"),
    "logging_steps": _different("whole optimizer steps only; TRL's fraction of the run (a value below 1) is refused"),
    "logging_first_step": _same(),
    "log_on_each_node": _refused("metrics are written by rank 0 alone", True),
    "logging_nan_inf_filter": _ignored("it changes only how a NaN/inf loss is logged, not training; here a logging "
                                       "window's mean skips NaN values"),
    "include_num_input_tokens_seen": _refused("input-token counts are not logged; drop the option", "no"),
    "log_level": _same(),
    "log_level_replica": _refused("processes other than rank 0 log warnings only, TRL's default", "warning"),
    "disable_tqdm": _same(),
    "report_to": _different("default `mlflow` here (TRL: `none`), logging only when `MLFLOW_TRACKING_URI` or "
                            "`MLFLOW_RUN_ID` is set (see `report_to` in this file's RLOOConfig table)"),
    "run_name": _same(),
    "project": _refused("the W&B project comes from `WANDB_PROJECT`, the MLflow experiment from "
                        "`MLFLOW_EXPERIMENT_NAME`", "huggingface"),
    "trackio_space_id": _refused("trackio is not a tracker here; use `report_to`", None),
    "trackio_bucket_id": _refused("trackio is not a tracker here; use `report_to`", None),
    "trackio_static_space_id": _refused("trackio is not a tracker here; use `report_to`", None),
    "eval_strategy": _same("`steps`, `epoch` or `no`; TRL's metrics with `eval_` (docs/configuration.md)"),
    "eval_steps": _same("None = `logging_steps`; below 1, a fraction of the run's steps"),
    "eval_delay": _same(),
    "per_device_eval_batch_size": _same("completions, not prompts; a multiple of `num_generations_eval`"),
    "prediction_loss_only": _ignored(f"{_EVAL_SHAPE}; there is no eval loss or prediction to keep"),
    "eval_on_start": _same("logged at step 0; a resumed run does not repeat it"),
    "eval_do_concat_batches": _ignored(_EVAL_SHAPE),
    "eval_use_gather_object": _ignored(_EVAL_SHAPE),
    "eval_accumulation_steps": _ignored(_EVAL_SHAPE),
    "include_for_metrics": _ignored(f"{_EVAL_SHAPE}; there are no `compute_metrics` inputs"),
    "batch_eval_metrics": _ignored(f"{_EVAL_SHAPE}; there is no `compute_metrics`"),
    "save_only_model": _refused("a checkpoint always holds the optimizer, scheduler and RNG state, so a resume "
                                "continues exactly; `final/` is the model alone", False),
    "save_strategy": _refused("checkpoints are written every `save_steps` (0: only the final model), TRL's default "
                              "`steps`", "steps"),
    "save_steps": _different("whole optimizer steps only (TRL's fraction below 1 is refused); 0 writes only the "
                             "final model, where TRL says `save_strategy: no`"),
    "save_on_each_node": _refused("rank 0 writes checkpoints to `output_dir`, which must be shared storage", False),
    "save_total_limit": _same(),
    "enable_jit_checkpoint": _refused("checkpoints are written every `save_steps`; a killed run resumes from the "
                                      "last one with `--resume_from_checkpoint latest`", False),
    "push_to_hub": _refused(_HUB, False),
    "hub_token": _ignored("read only when pushing to the Hub, which is refused (`push_to_hub`)"),
    "hub_private_repo": _ignored("read only when pushing to the Hub, which is refused (`push_to_hub`)"),
    "hub_model_id": _ignored("read only when pushing to the Hub, which is refused (`push_to_hub`)"),
    "hub_strategy": _ignored("read only when pushing to the Hub, which is refused (`push_to_hub`)"),
    "hub_always_push": _ignored("read only when pushing to the Hub, which is refused (`push_to_hub`)"),
    "hub_revision": _ignored("read only when pushing to the Hub, which is refused (`push_to_hub`)"),
    "load_best_model_at_end": _refused("keeping the checkpoint with the best eval metric is not built; `final/` is "
                                       "the last step's model", False),
    "metric_for_best_model": _ignored("used only with `load_best_model_at_end`, which is refused"),
    "greater_is_better": _ignored("used only with `load_best_model_at_end`, which is refused"),
    "ignore_data_skip": _refused("a resume always continues the prompt order where the run stopped", False),
    "restore_callback_states_from_checkpoint": _refused("there are no Trainer callbacks here", False),
    "full_determinism": _refused("runs are seeded by `seed`; deterministic kernels (`torch.use_deterministic_"
                                 "algorithms`) are not switched on", False),
    "seed": _same(),
    "data_seed": _refused("the prompt order is seeded by `seed`", None),
    "use_cpu": _same("handled by the command line: the GPUs are hidden (`CUDA_VISIBLE_DEVICES=`) before torch loads"),
    "accelerator_config": _refused("give accelerate's options to `accelerate launch` (--config_file)", None),
    "parallelism_config": _refused("tensor/context/sequence parallel training is not built; data parallel and "
                                   "DeepSpeed ZeRO come from `accelerate launch`", None),
    "dataloader_drop_last": _refused("every prompt is used; a short last batch is filled from the next epoch", False),
    "dataloader_num_workers": _ignored(_DATALOADER),
    "dataloader_pin_memory": _ignored(_DATALOADER),
    "dataloader_persistent_workers": _ignored(_DATALOADER),
    "dataloader_prefetch_factor": _ignored(_DATALOADER),
    "dataloader_multiprocessing_context": _ignored(_DATALOADER),
    "dataloader_in_order": _ignored(_DATALOADER),
    "remove_unused_columns": _refused("every dataset column reaches the reward functions, as with TRL's default",
                                      False),
    "label_names": _ignored(f"there are no labels in RLOO; {_AS_TRL_RLOO}"),
    "train_sampling_strategy": _refused("prompts are shuffled each epoch (`shuffle_dataset`), TRL's `random`",
                                        "random"),
    "length_column_name": _ignored("used only by the `group_by_length` sampling strategy, which is refused"),
    "ddp_find_unused_parameters": _refused("set by accelerate; give it in the accelerate config", None),
    "ddp_bucket_cap_mb": _refused("set by accelerate; give it in the accelerate config", None),
    "ddp_broadcast_buffers": _refused("set by accelerate; give it in the accelerate config", None),
    "ddp_static_graph": _refused("set by accelerate; give it in the accelerate config", None),
    "ddp_backend": _refused("chosen by accelerate (nccl on GPU, gloo on CPU); give it to `accelerate launch`", None),
    "ddp_timeout": _refused("the process-group timeout is accelerate's default, TRL's 1800 s", 1800),
    "fsdp": _refused(_FSDP_BY_PROFILE, None),
    "fsdp_config": _refused(_FSDP_BY_PROFILE, None),
    "deepspeed": _different("DeepSpeed runs through an accelerate launch profile: outside a DeepSpeed launch the flag is "
                            "refused with the exact `accelerate launch` command; under one the JSON's ZeRO stage must match "
                            "the profile's"),
    "debug": _refused("transformers' underflow/overflow debug hooks are not built", ""),
    "skip_memory_metrics": _ignored("logging only: on GPU `memory/max_allocated_gib` is logged whatever this says"),
    "do_train": _ignored("the command trains; TRL's script ignores it too"),
    "do_eval": _ignored("`eval_strategy` decides; TRL's script does not read it either"),
    "do_predict": _ignored("TRL's RLOO script never predicts"),
    "resume_from_checkpoint": _same("a checkpoint path as in TRL; also `latest` (the newest complete checkpoint, "
                                    "or a fresh start)"),
    "local_rank": _ignored("set by the launcher; the rank comes from the environment (`RANK`, `LOCAL_RANK`)"),
    # ------------------------------------------------------------ RLOOConfig: TRL's own
    "model_init_kwargs": _same(),
    "trust_remote_code": _same(),
    "router_aux_loss_coef": _same(),
    "disable_dropout": _same(),
    "num_generations": _same(),
    "num_generations_eval": _same(),
    "max_completion_length": _same(),
    "ds3_gather_for_generation": _refused(
        "under ZeRO-3 the policy is always gathered for generation (TRL's default true)", True),
    "shuffle_dataset": _same(),
    "pad_to_multiple_of": _ignored("padding only shapes tensors, not what is trained"),
    "generation_batch_size": _same(),
    "steps_per_generation": _same(),
    "temperature": _same(),
    "top_p": _same(),
    "top_k": _same("0 and null both mean off (TRL's default 0, ours null)"),
    "min_p": _same(),
    "generation_kwargs": _same(),
    "chat_template_kwargs": _same(),
    "repetition_penalty": _same(),
    "cache_implementation": _refused("the HF backend uses the model's default cache (or the engine's fused "
                                     "decode); drop the option", None),
    "use_vllm": _same(),
    "vllm_mode": _same(),
    "vllm_model_impl": _refused("vLLM runs its own model implementation, TRL's default `vllm`", "vllm"),
    "vllm_enable_sleep_mode": _same(),
    "vllm_structured_outputs_regex": _same(),
    "vllm_server_base_url": _same(),
    "vllm_server_host": _same(),
    "vllm_server_port": _same(),
    "vllm_server_timeout": _same(),
    "vllm_group_port": _same(),
    "vllm_gpu_memory_utilization": _same(),
    "vllm_max_model_length": _different("colocate mode only (server mode: `rloo-engine vllm-serve --max_model_len`); "
                                        "unset, it is max_prompt_length + max_completion_length capped at the "
                                        "model's positions (TRL: the model config's)"),
    "vllm_tensor_parallel_size": _same(),
    "beta": _same(),
    "num_iterations": _same(),
    "epsilon": _same(),
    "epsilon_high": _same(),
    "reward_weights": _same(),
    "normalize_advantages": _same("the mean and std of every scorable row of every process"),
    "reward_clip_range": _same(),
    "mask_truncated_completions": _same(),
    "sync_ref_model": _same(),
    "ref_model_mixup_alpha": _same(),
    "ref_model_sync_steps": _same(),
    "log_completions": _same(),
    "log_multimodal": _same("images saved beside completions.jsonl and shown in the MLflow completions table"),
    "num_completions_to_print": _same(),
    "log_unique_prompts": _refused("completions are logged per row (`completions.jsonl`)", False),
    "use_transformers_continuous_batching": _refused(
        "the HF backend decodes with `generate` or the engine's fused decode; use `use_vllm` for batched serving",
        False),
    "transformers_continuous_batching_config": _refused(
        "continuous batching is not built (`use_transformers_continuous_batching`)", None),
    "use_transformers_paged": _refused(
        "paged attention is not built for the HF backend; use `use_vllm`", False),
    # ------------------------------------------------------------ ModelConfig
    "model_name_or_path": _same(),
    "model_revision": _same(),
    "dtype": _same(),
    "attn_implementation": _same(),
    "use_peft": _same(),
    "lora_r": _same(),
    "lora_alpha": _same(),
    "lora_dropout": _same(),
    "lora_target_modules": _same(),
    "lora_target_parameters": _refused("LoRA on parameters (MoE experts) is not built; use `lora_target_modules`",
                                       None),
    "lora_modules_to_save": _same(),
    "lora_task_type": _different("only `CAUSAL_LM`: the policy is a causal LM (TRL's `SEQ_CLS` trains reward models)"),
    "use_rslora": _same(),
    "use_dora": _same(),
    "load_in_8bit": _same(),
    "load_in_4bit": _same(),
    "bnb_4bit_quant_type": _same(),
    "use_bnb_nested_quant": _same(),
    "bnb_4bit_quant_storage": _same(),
    # ------------------------------------------------------------ DatasetMixtureConfig
    "datasets": _refused("one prompt dataset per run: give `dataset_name` (a mixture: concatenate the files first)",
                         []),
    "streaming": _refused("prompts are loaded whole (a prompt set is small)", False),
    "test_split_size": _ignored(f"{_EVAL_SHAPE}; this option has no effect there"),
}

# Defaults kept deliberately different from TRL's: (ours, TRL's, why); printed once at the start of a run that
# leaves them unset, so a TRL command line never runs differently in silence.
DEFAULT_DIFFERENCES: dict[str, tuple[Any, Any, str]] = {
    "bf16": (False, True, "TRL's true stops with an error on a machine without bf16 unless --use_cpu, and float32 "
             "keeps the CPU fast paths (decode-time log-probs, fused decode)"),
    "gradient_checkpointing": (False, True, "it saves memory at ~20-30% more time and turns off the shared-prompt "
                               "training forward; the gradients are the same"),
}

# TRL spellings that are not fields but are accepted anyway.
ALIASES = {"torch_dtype": "dtype"}


def counts() -> dict[str, int]:
    """How many TRL fields are same, different, ignored and refused."""
    out = {"same": 0, "different": 0, "ignored": 0, "refused": 0}
    for entry in TRL_FIELDS.values():
        out[entry.kind] += 1
    return out


@dataclass
class TrlTranslation:
    """What TRL-spelt options became: our values, the ignored names, and the refusals (one line each)."""

    values: dict[str, Any]
    ignored: list[str]
    refused: list[str]
    use_cpu: bool = False


def _equal(given: Any, default: Any) -> bool:
    """Whether a value from YAML or the command line is TRL's default (`no` may arrive as YAML's or argparse's False)."""
    if given == default or (isinstance(given, str) and trl_scalar(given) == default):
        return True
    if isinstance(default, str) and isinstance(given, bool):
        return default.lower() in (("yes", "true", "on") if given else ("no", "false", "off"))
    return default is None and given in ("none", "None", "null")


def trl_scalar(text: str) -> Any:
    """A command-line token as TRL's parser would type it: a bool word, none, a number, else the text."""
    low = text.lower()
    if low in ("true", "t", "yes", "y"):
        return True
    if low in ("false", "f", "no", "n"):
        return False
    if low in ("none", "null"):
        return None
    for parse in (int, float):
        try:
            return parse(text)
        except ValueError:
            pass
    return text


def _reward_func_path(path: Any) -> Any:
    """TRL's dotted `pkg.module.func` as our `pkg.module:func`; anything else as it is."""
    if isinstance(path, str) and ":" not in path and "." in path:
        module, _, name = path.rpartition(".")
        return f"{module}:{name}"
    return path


def translate(values: dict[str, Any], our_fields: set[str], source: str) -> TrlTranslation:
    """Our option values from a mapping that may use TRL's spellings (from YAML or the command line).

    Our own fields pass through; TRL-only fields are translated, ignored or refused as TRL_FIELDS says. Keys that
    are neither stay in, for RLOOConfig to reject as unknown.
    """
    out: dict[str, Any] = {}
    ignored: list[str] = []
    refused: list[str] = []
    use_cpu = False
    for key, value in values.items():
        key = ALIASES.get(key, key)
        entry = TRL_FIELDS.get(key)
        if key == "reward_funcs" and isinstance(value, list):
            value = [_reward_func_path(v) for v in value]
        if key == "warmup_steps" and isinstance(value, (int, float)) and 0 < value < 1:
            out["warmup_ratio"] = float(value)
            continue
        if key in ("logging_steps", "save_steps") and isinstance(value, float) and 0 < value < 1:
            refused.append(f"{source}: {key}: {value!r} is not supported: {entry.note}")
            continue
        if key in our_fields or entry is None:
            out[key] = value
        elif entry.ours is not None and entry.ours in our_fields:
            out[entry.ours] = value
        elif key == "use_cpu":
            use_cpu = bool(trl_scalar(value) if isinstance(value, str) else value)
        elif entry.kind == "ignored":
            ignored.append(key)
        elif entry.kind == "refused" and entry.trl_default is not _NO_DEFAULT and _equal(value, entry.trl_default):
            continue  # TRL's default asks for nothing
        else:
            why = entry.note if entry.kind == "refused" else "not implemented in this version"
            refused.append(f"{source}: {key}: {value!r} is not supported: {why}")
    return TrlTranslation(out, ignored, refused, use_cpu)


def hide_gpus() -> None:
    """`use_cpu`: train on CPU even where a GPU is visible (before torch loads, so nothing has touched CUDA)."""
    os.environ["CUDA_VISIBLE_DEVICES"] = ""


def markdown_table() -> str:
    """The table as Markdown, for docs/configuration.md."""
    rows = [f"| `{name}` | {entry.kind} | {_note(entry)} |" for name, entry in sorted(TRL_FIELDS.items())]
    c = counts()
    head = (f"{len(TRL_FIELDS)} fields: {c['same']} same, {c['different']} different, {c['ignored']} ignored "
            f"(accepted, named on stderr), {c['refused']} refused (a configuration error, except at TRL's "
            "default value). Dashed spellings (`--num-train-epochs`) and `--no_<flag>` for a boolean "
            "option are accepted as by TRL's parser; a `--config` YAML may hold every field below and an `env:` "
            "mapping, as TRL's.\n\n")
    return head + "| TRL field | here | how, why, or what to do instead |\n|---|---|---|\n" + "\n".join(rows) + "\n"


def _note(entry: TrlField) -> str:
    parts = [f"as `{entry.ours}`" if entry.ours else "", entry.note]
    if entry.kind == "refused" and entry.trl_default is not _NO_DEFAULT:
        parts.append(f"(TRL's default `{entry.trl_default!r}` is accepted)")
    return "; ".join(p for p in parts if p).replace("|", "\\|")
