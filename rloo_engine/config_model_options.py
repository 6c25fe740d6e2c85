"""The model-loading and LoRA options of RLOOConfig, with TRL's `ModelConfig` names: where the policy's files come
from and how they load (revision, remote code, `model_init_kwargs`, quantisation, GPU-only kernels, DeepSpeed), and
the LoRA adapter. Mixins on the one config base, so `RLOOConfig` stays one class of one room; the checks that
combine these with the rest of the options are `RLOOConfig`'s."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import AliasChoices, model_validator

from rloo_engine.config_base import F, StrictModel


class ModelLoadingOptions(StrictModel):
    """How the policy (and reference, and reward model where said) are loaded."""

    model_name_or_path: str | None = F(
        None,
        "Policy to train: a local directory in `save_pretrained` format or a hub id. Also the "
        "frozen reference model unless LoRA is on (then the reference is the adapter-disabled base). Required by "
        "`rloo-engine train`; from Python, `RLOOTrainer(model=...)` gives it.",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = F(
        "float32",
        "Dtype the policy and reference weights are loaded in. float32 is the safe default on CPU; on "
        "GPUs prefer `bfloat16` weights or keep float32 weights and set `bf16: true` for mixed precision.",
        validation_alias=AliasChoices("dtype", "torch_dtype"),
    )
    attn_implementation: str | None = F(
        None, "Attention kernel passed to `from_pretrained` (`sdpa`, `eager`, `flash_attention_2`). None = library default."
    )

    # ---------------------------------------------------------------- loading the model (TRL's ModelConfig names)
    model_revision: str = F(
        "main",
        "Branch, tag or commit of `model_name_or_path` on the hub, passed as `revision` to every load of the policy's "
        "files: weights, config, tokenizer, generation config, the reference and a colocated vLLM engine. A local "
        "directory has no revisions and ignores it, as transformers does. The reward model is loaded at its own "
        "`main` (TRL passes the policy's revision to it too, which names nothing in another repository).",
        min_length=1,
    )
    trust_remote_code: bool = F(
        False,
        "Let a model whose config names Python code of its own (`auto_map`) run that code: the policy, reference, "
        "their config and tokenizer, the reward model and its tokenizer, and a colocated vLLM engine (TRL applies "
        "it to the same loads). Off by default: the code runs with your permissions, so turn it on only for a "
        "source you trust.",
    )
    model_init_kwargs: dict[str, Any] | None = F(
        None,
        "Extra keyword arguments for the policy's and reference's `from_pretrained` (a mapping, or its JSON text), "
        "e.g. `{\"low_cpu_mem_usage\": true}`. As in `trl rloo`, `dtype`/`torch_dtype`, `attn_implementation`, "
        "`revision` and `trust_remote_code` given here set those options (`model_revision` for `revision`); given "
        "both here and as their own option with different values, the config is refused. `device_map` is refused "
        "(accelerate places the models) and so is `quantization_config` (use `load_in_4bit`/`load_in_8bit`).",
    )

    # ---------------------------------------------------------------- GPU-only speed and memory options (TRL names)
    gradient_checkpointing_kwargs: dict[str, Any] | None = F(
        None,
        "Keyword arguments of `torch.utils.checkpoint` for `gradient_checkpointing` (`use_reentrant`, "
        "`preserve_rng_state`, `determinism_check`, `debug`). None = `{\"use_reentrant\": false}` (TRL's choice: "
        "the non-reentrant variant works with frozen inputs and LoRA). Needs `gradient_checkpointing: true` (TRL's "
        "RLOOConfig defaults it to true; here it is false).",
    )
    tf32: bool | None = F(
        None,
        "TF32 matmuls and convolutions on Ampere or newer NVIDIA GPUs (transformers' `enable_tf32`). None = leave "
        "torch's setting. `true` without such a GPU is refused, as transformers refuses it; `false` turns TF32 off "
        "where it exists and is a no-op elsewhere.",
    )
    use_liger_kernel: bool = F(
        False,
        "Patch the policy and reference with Liger's Triton kernels (RMSNorm, RoPE, SwiGLU; not its fused linear "
        "cross-entropy, which replaces the forward the log-probs are read from, as TRL excludes it). Needs CUDA and "
        "the `liger-kernel` package; refused at start-up otherwise. Not yet run on a GPU here.",
    )
    load_in_4bit: bool = F(
        False,
        "Load the policy's base weights 4-bit with bitsandbytes (QLoRA). Needs `use_peft: true` (the base is "
        "frozen), CUDA and the `bitsandbytes` package; refused at start-up otherwise, and with `use_vllm`. Not yet "
        "run on a GPU here.",
    )
    load_in_8bit: bool = F(
        False, "Load the policy's base weights 8-bit with bitsandbytes; as `load_in_4bit` (and not with it)."
    )
    bnb_4bit_quant_type: Literal["fp4", "nf4"] = F("nf4", "4-bit quantisation type with `load_in_4bit`.")
    use_bnb_nested_quant: bool = F(
        False, "Quantise the 4-bit quantisation constants too (`bnb_4bit_use_double_quant`), with `load_in_4bit`."
    )
    bnb_4bit_quant_storage: str | None = F(
        None, "Storage dtype of the packed 4-bit weights (e.g. `uint8`, `bfloat16`), with `load_in_4bit`. None = "
        "bitsandbytes' default."
    )
    deepspeed: str | None = F(
        None,
        "A DeepSpeed JSON config (transformers' `--deepspeed`). The engine runs DeepSpeed only through an accelerate "
        "launch profile, so without one it refuses with the `accelerate launch --config_file <profile> ...` command to "
        "use; under one, the JSON's ZeRO stage must match the profile's and the profile's JSON is what runs.",
    )

    @model_validator(mode="before")
    @classmethod
    def _model_init_kwargs_into_fields(cls, values: Any) -> Any:
        """`model_init_kwargs` keys that have an option of their own set that option (as `trl rloo` merges them), so
        the rest of the engine reads one place; the same key set twice with different values is refused."""
        if not isinstance(values, dict) or values.get("model_init_kwargs") is None:
            return values
        kwargs = values["model_init_kwargs"]
        if isinstance(kwargs, str):
            try:
                kwargs = json.loads(kwargs)
            except json.JSONDecodeError as err:
                raise ValueError(f"model_init_kwargs: {kwargs!r} is not JSON ({err}); expected a mapping") from None
        if not isinstance(kwargs, dict):
            raise ValueError(f"model_init_kwargs: {kwargs!r}; expected a mapping of from_pretrained keyword arguments")
        values, kwargs = dict(values), dict(kwargs)
        for key, why in _MODEL_INIT_KWARGS_REFUSED.items():
            if key in kwargs:
                raise ValueError(f"model_init_kwargs.{key}: {kwargs[key]!r}; {why}")
        for key, field in _MODEL_INIT_KWARGS_FIELDS.items():
            if key not in kwargs:
                continue
            value = kwargs.pop(key)
            given = [name for name in (field, *_FIELD_ALIASES.get(field, ())) if name in values]
            if given and values[given[0]] != value:
                raise ValueError(f"model_init_kwargs.{key}: {value!r} conflicts with {given[0]}: "
                                 f"{values[given[0]]!r}; set it in one place")
            values[field] = value
        values["model_init_kwargs"] = kwargs
        return values

    def _check_trl_model_options(self) -> None:
        """The TRL loading, optimiser and GPU-only options: combinations that cannot mean what they say (it reads
        the other mixins' fields too: it runs on the whole RLOOConfig)."""
        if self.gradient_checkpointing_kwargs is not None:
            if not self.gradient_checkpointing:
                raise ValueError(
                    f"gradient_checkpointing_kwargs: {self.gradient_checkpointing_kwargs} with gradient_checkpointing: "
                    "false has no effect; set gradient_checkpointing: true (TRL's RLOOConfig defaults it to true, "
                    "this engine to false) or drop gradient_checkpointing_kwargs"
                )
            unknown = sorted(set(self.gradient_checkpointing_kwargs) - CHECKPOINT_KWARGS)
            if unknown:
                raise ValueError(f"gradient_checkpointing_kwargs: unknown key(s) {unknown}; expected some of "
                                 f"{sorted(CHECKPOINT_KWARGS)} (torch.utils.checkpoint's keyword arguments)")
        from rloo_engine.schedules import check_scheduler_kwargs

        check_scheduler_kwargs(self.lr_scheduler_type, self.lr_scheduler_kwargs)
        if self.load_in_4bit and self.load_in_8bit:
            raise ValueError("load_in_4bit and load_in_8bit: both true; choose one")
        quantized = "load_in_4bit" if self.load_in_4bit else "load_in_8bit" if self.load_in_8bit else None
        if quantized and not self.use_peft:
            raise ValueError(f"{quantized}: true without use_peft: true; quantised base weights cannot be trained, "
                             "only LoRA adapters on them (as in TRL)")
        if quantized and self.use_vllm:
            raise ValueError(f"{quantized}: true with use_vllm: true; the weight sync into vLLM does not handle "
                             "quantised weights here; use the HF backend (use_vllm: false)")
        if not self.load_in_4bit and (self.use_bnb_nested_quant or self.bnb_4bit_quant_storage is not None):
            name = "use_bnb_nested_quant" if self.use_bnb_nested_quant else "bnb_4bit_quant_storage"
            raise ValueError(f"{name}: set without load_in_4bit: true; it configures 4-bit loading only")
        if self.vllm_structured_outputs_regex is not None:
            if not self.use_vllm:
                raise ValueError(f"vllm_structured_outputs_regex: {self.vllm_structured_outputs_regex!r} without "
                                 "use_vllm: true; only vLLM's decoding can constrain completions")
            if "structured_outputs" in self.generation_kwargs:
                raise ValueError("vllm_structured_outputs_regex and generation_kwargs.structured_outputs: both set; "
                                 "give the constraint in one place")
            try:
                re.compile(self.vllm_structured_outputs_regex)
            except re.error as err:
                raise ValueError(f"vllm_structured_outputs_regex: {self.vllm_structured_outputs_regex!r} is not a "
                                 f"regular expression ({err})") from None
        if self.vllm_max_model_length is not None and self.vllm_max_model_length <= self.max_completion_length:
            raise ValueError(f"vllm_max_model_length: {self.vllm_max_model_length}; expected more than "
                             f"max_completion_length={self.max_completion_length} (prompt and completion share it)")
        if self.deepspeed is not None and not Path(self.deepspeed).is_file():
            raise ValueError(f"deepspeed: {self.deepspeed} does not exist or is not a file; expected a DeepSpeed "
                             "JSON config")


class LoraOptions(StrictModel):
    """The LoRA adapter trained instead of all weights."""

    # ---------------------------------------------------------------- LoRA
    use_peft: bool = F(False, "Train LoRA adapters instead of all weights (needs the `peft` extra).")
    lora_r: int = F(16, "LoRA rank.", ge=1)
    lora_alpha: int = F(32, "LoRA scaling alpha.", ge=1)
    lora_dropout: float = F(0.05, "LoRA dropout.", ge=0.0, lt=1.0)
    lora_target_modules: list[str] | None = F(
        None, "Module names to adapt (e.g. q_proj v_proj); None = peft's default for the architecture."
    )

    # LoRA variants, with TRL's ModelConfig names (`trl.get_peft_config`).
    use_rslora: bool = F(
        False, "Rank-stabilised LoRA: scale the adapter by lora_alpha / sqrt(r) instead of lora_alpha / r."
    )
    use_dora: bool = F(
        False,
        "DoRA: each adapted weight's update split into a magnitude (a trained vector) and a direction (LoRA). Linear "
        "and Conv layers only; slower than plain LoRA in training.",
    )
    lora_modules_to_save: list[str] | None = F(
        None,
        "Modules trained in full beside the adapters and saved with them (e.g. `lm_head`, `embed_tokens`). None = "
        "none.",
    )
    lora_task_type: Literal["CAUSAL_LM"] = F(
        "CAUSAL_LM",
        "PEFT task type. The policy is a causal LM, so `CAUSAL_LM` is the only value that fits (TRL's `SEQ_CLS` is for "
        "training reward models).",
    )


# `model_init_kwargs` keys that are options of their own (`trl rloo` builds them from ModelConfig), and their aliases.
_MODEL_INIT_KWARGS_FIELDS = {"dtype": "dtype", "torch_dtype": "dtype", "attn_implementation": "attn_implementation",
                             "revision": "model_revision", "trust_remote_code": "trust_remote_code"}
_FIELD_ALIASES = {"dtype": ("torch_dtype",)}
_MODEL_INIT_KWARGS_REFUSED = {
    "device_map": "accelerate places the models on this process's device; drop it",
    "quantization_config": "use load_in_4bit / load_in_8bit (with bnb_4bit_quant_type, use_bnb_nested_quant)",
}
# What torch.utils.checkpoint takes that a config file can spell (not `context_fn`, a callable).
CHECKPOINT_KWARGS = {"use_reentrant", "preserve_rng_state", "determinism_check", "debug", "early_stop"}
