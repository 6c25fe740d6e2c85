"""Loads the policy, its tokenizer and the frozen reference model; wraps LoRA when asked."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, PreTrainedModel

from rloo_engine.config import RLOOConfig
from rloo_engine.config_base import ConfigError

# `dtype` (train.dtype) to what from_pretrained takes: the one table the policy, reference, reward model and the
# pipeline's reward check load with.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "auto": "auto"}


def hub_kwargs(cfg: RLOOConfig) -> dict:
    """What every load of the policy's files takes: its revision and whether its own code may run."""
    return {"revision": cfg.model_revision, "trust_remote_code": cfg.trust_remote_code}


def model_init_kwargs(cfg: RLOOConfig) -> dict:
    """`from_pretrained` keyword arguments of the policy and reference, merged as `trl rloo` merges them (the keys
    that are options of their own were moved into those options when the config loaded)."""
    kwargs = {**(cfg.model_init_kwargs or {}), **hub_kwargs(cfg), "dtype": DTYPES[cfg.dtype]}
    if cfg.attn_implementation:
        kwargs["attn_implementation"] = cfg.attn_implementation
    if cfg.load_in_4bit or cfg.load_in_8bit:
        kwargs.update(quantized_loading(cfg))
    return kwargs


def quantized_loading(cfg: RLOOConfig) -> dict:
    """bitsandbytes loading, as TRL's `get_quantization_config` (machine_flags refused it without CUDA)."""
    from transformers import BitsAndBytesConfig

    if cfg.load_in_8bit:
        quantization = BitsAndBytesConfig(load_in_8bit=True)
    else:
        quantization = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_compute_dtype=DTYPES[cfg.dtype] if cfg.dtype != "auto" else None,
            bnb_4bit_quant_type=cfg.bnb_4bit_quant_type, bnb_4bit_use_double_quant=cfg.use_bnb_nested_quant,
            bnb_4bit_quant_storage=cfg.bnb_4bit_quant_storage,
        )
    # Quantised weights are made on the device they load to; accelerate has set this process's device by now.
    return {"quantization_config": quantization, "device_map": {"": torch.cuda.current_device()}}


def load_tokenizer(path: str, cfg: RLOOConfig | None = None):
    """Policy tokenizer with a pad token (EOS when the checkpoint has none), left padding for generation."""
    try:
        tok = AutoTokenizer.from_pretrained(path, **(hub_kwargs(cfg) if cfg is not None else {}))
    except (OSError, ValueError) as err:
        raise ConfigError(f"model_name_or_path: cannot load a tokenizer from {path!r}: {err}") from None
    if len(tok) < 2:  # transformers 5 makes an empty one where no tokenizer files are
        raise ConfigError(f"model_name_or_path: {path!r} has no usable tokenizer ({len(tok)} token); expected the "
                          "tokenizer saved with the model")
    if tok.eos_token_id is None:
        raise ConfigError(f"model_name_or_path: tokenizer of {path!r} has no eos_token; completions could never end")
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    return tok


def eos_token_ids(tokenizer, model_path: str | None, revision: str | None = None,
                  generation_config: GenerationConfig | None = None) -> list[int]:
    """Every id that ends a completion: the tokenizer's EOS plus the model's `generation_config.eos_token_id`.

    Chat models list several (Llama-3: 128001, 128008, 128009; Qwen2.5-Instruct: 151645, 151643), and
    the tokenizer's own EOS is often not the one the chat template ends a turn with.
    """
    ids = [tokenizer.eos_token_id]
    try:  # a model object's own, else the checkpoint's
        configured = (generation_config or GenerationConfig.from_pretrained(model_path, revision=revision)).eos_token_id
    except (OSError, TypeError):  # no generation_config.json; no path (a model object without one)
        configured = None
    if configured is not None:
        ids += configured if isinstance(configured, list) else [configured]
    return list(dict.fromkeys(i for i in ids if i is not None))


def generative_auto_class(path: str, cfg: RLOOConfig):
    """`AutoModelForImageTextToText` for a vision-language checkpoint (its config is one that class maps, as TRL
    decides), else `AutoModelForCausalLM`."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    config = AutoConfig.from_pretrained(path, **hub_kwargs(cfg))
    if config.model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES:
        from transformers import AutoModelForImageTextToText

        return AutoModelForImageTextToText
    return AutoModelForCausalLM


def load_causal_lm(path: str, cfg: RLOOConfig, field: str = "model_name_or_path",
                   weights: bool = True) -> PreTrainedModel:
    """`weights=False`: the model without reading its weights (`empty_model`), for a process that is sent them."""
    try:
        auto_class = generative_auto_class(path, cfg)
        if weights or cfg.load_in_4bit or cfg.load_in_8bit:  # quantised weights are made as they load
            model = auto_class.from_pretrained(path, **model_init_kwargs(cfg))
        else:
            model = empty_model(auto_class, path, DTYPES[cfg.dtype], cfg.trust_remote_code,
                                cfg.model_revision, cfg.attn_implementation)
    except (OSError, ValueError) as err:
        hint = "" if Path(path).exists() or "/" in path else " (not a local directory either)"
        if not Path(path).exists() and cfg.model_revision != "main":
            hint += f" at model_revision {cfg.model_revision!r}"
        raise ConfigError(f"{field}: cannot load a causal LM from {path!r}{hint}: {err}") from None
    return model


def empty_model(auto_class, path: str, dtype: torch.dtype | str, trust_remote_code: bool = False,
                revision: str | None = None, attn_implementation: str | None = None) -> PreTrainedModel:
    """`auto_class`'s model of `path` with its parameters on the meta device and its buffers real (rotary tables are
    computed, not loaded): FSDP2's `fsdp_cpu_ram_efficient_loading`, where only the main process reads the weights
    and accelerate sends each process its shards (`fsdp2_prepare_model`). transformers 5.2x reads them on every rank
    even then, so every process held each model whole before it was sharded."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig

    hub = {"revision": revision, "trust_remote_code": trust_remote_code}
    config = AutoConfig.from_pretrained(path, **hub)
    if dtype == "auto":
        dtype = getattr(config, "dtype", None) or torch.float32
    extra = {"attn_implementation": attn_implementation} if attn_implementation else {}
    with init_empty_weights(include_buffers=False):
        model = auto_class.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code, **extra)
    model.tie_weights()  # from_pretrained ties them as it loads; from_config leaves a tied head a parameter of its own
    with contextlib.suppress(OSError):
        model.generation_config = GenerationConfig.from_pretrained(path, revision=revision)
    return model


def disable_dropout(model: torch.nn.Module) -> None:
    """Zero every dropout so the training forward reproduces the sampling log-probs exactly."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0


def has_active_dropout(model: torch.nn.Module) -> bool:
    """Whether a training-mode forward of `model` drops anything: a `torch.nn.Dropout` with p > 0, or a dropout
    rate in its config (e.g. `attention_dropout`, which attention applies functionally in training mode)."""
    if any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules()):
        return True

    def rates(config: dict) -> list[float]:
        found = []
        for key, value in config.items():
            if isinstance(value, dict):
                found += rates(value)
            elif isinstance(key, str) and ("dropout" in key or key.endswith("pdrop")) \
                    and isinstance(value, (int, float)) and not isinstance(value, bool):
                found.append(float(value))
        return found

    config = getattr(model, "config", None)
    return any(rate > 0 for rate in rates(config.to_dict() if config is not None else {}))


def load_policy(cfg: RLOOConfig, given: torch.nn.Module | None = None, peft_config: Any = None,
                weights: bool = True) -> PreTrainedModel:
    """The trainable policy; a peft model with only LoRA weights trainable when `use_peft`. `given`: the model object
    of `RLOOTrainer(model=...)` (prepared in place; a PeftModel keeps its adapters), `peft_config` its `peft_config`.
    `weights=False`: without reading the checkpoint (`empty_model`; LoRA weights too come from the main process)."""
    model = given if given is not None else load_causal_lm(cfg.model_name_or_path, cfg, weights=weights)
    if cfg.use_liger_kernel:
        apply_liger_kernels(model)
    if cfg.gradient_checkpointing:
        checkpoint_kwargs = cfg.gradient_checkpointing_kwargs or {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x name
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=dict(checkpoint_kwargs))
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=dict(checkpoint_kwargs))
        model.config.use_cache = False
    if not cfg.use_peft or hasattr(model, "peft_config"):  # a PeftModel given as it is
        if cfg.disable_dropout:
            disable_dropout(model)
        return model
    try:
        from peft import get_peft_model
    except ImportError:
        raise ConfigError("use_peft: true, but peft is not installed; pip install 'rloo-pipeline[peft]'") from None
    lora = peft_config or lora_config(cfg)
    if cfg.gradient_checkpointing:
        model.enable_input_require_grads()
    model = get_peft_model(model, lora)
    if cfg.disable_dropout:  # after wrapping: PEFT adds its own `lora_dropout` modules
        disable_dropout(model)
    return model


def lora_config(cfg: RLOOConfig):
    """The peft LoraConfig of `cfg`, as TRL's `get_peft_config` builds it from ModelConfig."""
    from peft import LoraConfig

    return LoraConfig(
        task_type=cfg.lora_task_type,
        r=cfg.lora_r,
        target_modules=cfg.lora_target_modules,
        lora_alpha=cfg.lora_alpha,
        lora_dropout=cfg.lora_dropout,
        bias="none",
        use_rslora=cfg.use_rslora,
        use_dora=cfg.use_dora,
        modules_to_save=cfg.lora_modules_to_save,
    )


def apply_liger_kernels(model: torch.nn.Module) -> None:
    """Liger's layer kernels, without its fused linear cross-entropy: that replaces the forward whose logits the
    log-probs are read from (TRL excludes it too). machine_flags refused `use_liger_kernel` without CUDA or the package."""
    from transformers.integrations.liger import apply_liger_kernel

    apply_liger_kernel(model, {"fused_linear_cross_entropy": False})


def load_reference(cfg: RLOOConfig, given: torch.nn.Module | None = None,
                   weights: bool = True) -> PreTrainedModel | None:
    """A separate frozen copy of the initial policy; None when beta == 0 or with LoRA (adapters off instead).
    `given`: that copy already made of a model object (`trainer_inputs.py`), frozen here. `weights`: as in
    `load_policy`."""
    if not cfg.has_reference_model or cfg.use_peft:
        return None
    ref = given if given is not None else load_causal_lm(cfg.model_name_or_path, cfg, weights=weights)
    if cfg.use_liger_kernel:
        apply_liger_kernels(ref)
    if cfg.disable_dropout:
        disable_dropout(ref)
    ref.requires_grad_(False)
    return ref.eval()


def reference_context(policy: torch.nn.Module, ref: torch.nn.Module | None):
    """Context in which `policy` computes reference log-probs: LoRA adapters disabled, no second copy."""
    if ref is None and hasattr(policy, "disable_adapter"):
        return policy.disable_adapter()
    return contextlib.nullcontext()


@torch.no_grad()
def sync_reference(policy: torch.nn.Module, ref: torch.nn.Module, alpha: float) -> None:
    """TR-DPO reference update: ref <- alpha * policy + (1 - alpha) * ref, parameter by parameter."""
    for p_ref, p_pol in zip(ref.parameters(), policy.parameters()):
        p_ref.mul_(1 - alpha).add_(p_pol.detach().to(p_ref.dtype), alpha=alpha)


class RouterAuxLoss:
    """A Mixture-of-Experts policy's load-balancing loss, as TRL weighs it: `router_aux_loss_coef`, else the
    architecture's own coefficient (0 when its config declares none); on only when the model returns router logits
    and the coefficient is not 0. `capture(model)` asks the forwards inside it for their router logits and keeps each
    forward's `aux_loss`. The trainer then runs each training forward whole: transformers' load-balancing loss
    fails on a shared prompt's split forward (its masks no longer match the router logits)."""

    def __init__(self, model: torch.nn.Module, coef: float | None):
        config = model.config.get_text_config()
        is_moe = hasattr(config, "output_router_logits")
        if coef and not is_moe:
            raise ConfigError(f"router_aux_loss_coef: {coef} but {type(model).__name__} is not a Mixture-of-Experts "
                              "model that returns its router logits, so there is no auxiliary loss to weight")
        self.coef = getattr(config, "router_aux_loss_coef", 0.0) if coef is None else coef
        self.enabled = is_moe and self.coef != 0.0
        self.losses: list[torch.Tensor] = []

    @contextlib.contextmanager
    def capture(self, model: torch.nn.Module):
        """Each forward of the causal LM inside `model` (under DDP, DeepSpeed or PEFT) returns its router loss."""
        self.losses = []
        if not self.enabled:
            yield self
            return
        lm = next(m for m in model.modules() if type(m).__name__.endswith("ForCausalLM"))
        handles = [lm.register_forward_pre_hook(lambda _m, args, kwargs: (args, {**kwargs, "output_router_logits": True}),
                                                with_kwargs=True),
                   lm.register_forward_hook(lambda _m, _args, out: self.losses.append(out.aux_loss))]
        try:
            yield self
        finally:
            for handle in handles:
                handle.remove()

    def mean(self) -> torch.Tensor:
        return torch.stack(self.losses).mean()
