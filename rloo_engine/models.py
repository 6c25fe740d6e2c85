"""Loads the policy, its tokenizer and the frozen reference model; wraps LoRA when asked."""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, PreTrainedModel

from rloo_engine.config import RLOOConfig
from rloo_engine.config_base import ConfigError

# `dtype` (train.dtype) to what from_pretrained takes: the one table the policy, reference, reward model and the
# pipeline's reward check load with.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "auto": "auto"}


def load_tokenizer(path: str):
    """Policy tokenizer with a pad token (EOS when the checkpoint has none), left padding for generation."""
    try:
        tok = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as err:
        raise ConfigError(f"model_name_or_path: cannot load a tokenizer from {path!r}: {err}") from None
    if tok.eos_token_id is None:
        raise ConfigError(f"model_name_or_path: tokenizer of {path!r} has no eos_token; completions could never end")
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    return tok


def eos_token_ids(tokenizer, model_path: str) -> list[int]:
    """Every id that ends a completion: the tokenizer's EOS plus the model's `generation_config.eos_token_id`.

    Chat models list several (Llama-3: 128001, 128008, 128009; Qwen2.5-Instruct: 151645, 151643), and
    the tokenizer's own EOS is often not the one the chat template ends a turn with.
    """
    ids = [tokenizer.eos_token_id]
    try:
        configured = GenerationConfig.from_pretrained(model_path).eos_token_id
    except OSError:  # no generation_config.json
        configured = None
    if configured is not None:
        ids += configured if isinstance(configured, list) else [configured]
    return list(dict.fromkeys(i for i in ids if i is not None))


def load_causal_lm(path: str, cfg: RLOOConfig, field: str = "model_name_or_path") -> PreTrainedModel:
    kwargs = {"dtype": DTYPES[cfg.dtype]}
    if cfg.attn_implementation:
        kwargs["attn_implementation"] = cfg.attn_implementation
    try:
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    except (OSError, ValueError) as err:
        hint = "" if Path(path).exists() or "/" in path else " (not a local directory either)"
        raise ConfigError(f"{field}: cannot load a causal LM from {path!r}{hint}: {err}") from None
    return model


def disable_dropout(model: torch.nn.Module) -> None:
    """Zero every dropout so the training forward reproduces the sampling log-probs exactly."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0


def load_policy(cfg: RLOOConfig) -> PreTrainedModel:
    """The trainable policy; a peft model with only LoRA weights trainable when `use_peft`."""
    model = load_causal_lm(cfg.model_name_or_path, cfg)
    if cfg.gradient_checkpointing:
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x name
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    if not cfg.use_peft:
        if cfg.disable_dropout:
            disable_dropout(model)
        return model
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise ConfigError("use_peft: true, but peft is not installed; pip install 'rloo-pipeline[peft]'") from None
    lora = LoraConfig(
        r=cfg.lora_r,
        lora_alpha=cfg.lora_alpha,
        lora_dropout=cfg.lora_dropout,
        target_modules=cfg.lora_target_modules,
        task_type="CAUSAL_LM",
    )
    if cfg.gradient_checkpointing:
        model.enable_input_require_grads()
    model = get_peft_model(model, lora)
    if cfg.disable_dropout:  # after wrapping: PEFT adds its own `lora_dropout` modules
        disable_dropout(model)
    return model


def load_reference(cfg: RLOOConfig) -> PreTrainedModel | None:
    """A separate frozen copy of the initial policy; None when beta == 0 or with LoRA (adapters off instead)."""
    if not cfg.has_reference_model or cfg.use_peft:
        return None
    ref = load_causal_lm(cfg.model_name_or_path, cfg)
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
