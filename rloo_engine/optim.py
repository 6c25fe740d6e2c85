"""The optimizer and learning-rate schedule of a run, from `optim`, `adam_*`, `lr_scheduler_type` and `lr_scheduler_kwargs`.

Names and meanings are transformers' (`TrainingArguments.optim`, `get_scheduler`), which TRL's RLOOConfig inherits.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from rloo_engine.config_base import ConfigError

if TYPE_CHECKING:
    from rloo_engine.config import RLOOConfig

# Devices torch's fused AdamW kernel runs on (torch 2.13: CPU, CUDA, MPS, XPU).
_FUSED_ADAMW_DEVICES = {"cpu", "cuda", "mps", "xpu"}


# Parameters transformers' Trainer exempts from weight decay, by name (`Trainer.get_decay_parameter_names`).
_NO_DECAY_NAME = re.compile(r"bias|layernorm|rmsnorm|(?:^|\.)norm(?:$|\.)|_norm(?:$|\.)")


def parameter_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """The trainable parameters in two groups, as transformers' Trainer builds them: `weight_decay` for weights,
    none for biases and normalisation layers (decaying a norm's scale toward 0 shrinks the activations)."""
    no_decay_types = tuple(m for m in (torch.nn.LayerNorm, getattr(torch.nn, "RMSNorm", None)) if m is not None)
    exempt = {f"{prefix}.{name}" if prefix else name
              for prefix, module in model.named_modules() if isinstance(module, no_decay_types)
              for name, _ in module.named_parameters(recurse=False)}
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if param.requires_grad:
            (no_decay if name in exempt or _NO_DECAY_NAME.search(name.lower()) else decay).append(param)
    # An empty group is left out: DeepSpeed drops it, and the schedule built on the groups would then miscount.
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def build_optimizer(cfg: RLOOConfig, params: list[torch.nn.Parameter] | list[dict],
                    say: Callable[[str], None] = print) -> torch.optim.Optimizer:
    """The optimizer `cfg.optim` names over the trainable `params` (a list, or `parameter_groups`)."""
    if cfg.optim == "adafactor":
        from transformers.optimization import Adafactor

        # As transformers' Trainer: a fixed learning rate the schedule drives, not Adafactor's own relative step.
        return Adafactor(params, lr=cfg.learning_rate, weight_decay=cfg.weight_decay, scale_parameter=False,
                         relative_step=False)
    fused = None
    if cfg.optim == "adamw_torch_fused":
        tensors = [t for group in params for t in group["params"]] if params and isinstance(params[0], dict) \
            else params
        # An empty model's parameters (`models.empty_model`, on the meta device) are given the main process's
        # weights on the launch's device: each process must choose the same kernel.
        devices = {p.device.type for p in tensors} - {"meta"}
        fused = devices <= _FUSED_ADAMW_DEVICES or None
        if fused is None:
            say(f"optim: adamw_torch_fused has no fused kernel for parameters on {sorted(devices)}; using "
                "adamw_torch (the per-tensor loop), which computes the same update")
    return torch.optim.AdamW(params, lr=cfg.learning_rate, betas=(cfg.adam_beta1, cfg.adam_beta2),
                             eps=cfg.adam_epsilon, weight_decay=cfg.weight_decay, fused=fused)


def build_scheduler(cfg: RLOOConfig, optimizer: torch.optim.Optimizer, total_steps: int):
    """transformers' `lr_scheduler_type` schedule over `total_steps`, with `lr_scheduler_kwargs`."""
    from transformers import get_scheduler

    warmup = cfg.warmup_steps or math.ceil(cfg.warmup_ratio * total_steps)
    try:
        return get_scheduler(cfg.lr_scheduler_type, optimizer, warmup, total_steps,
                             scheduler_specific_kwargs=dict(cfg.lr_scheduler_kwargs))
    except (TypeError, ValueError) as err:  # e.g. cosine_with_min_lr given neither min_lr nor min_lr_rate
        raise ConfigError(f"lr_scheduler_kwargs: {cfg.lr_scheduler_kwargs} for lr_scheduler_type "
                          f"{cfg.lr_scheduler_type!r}: {err}") from None
