"""The optimizer and learning-rate schedule of a run, from `optim`, `adam_*`, `lr_scheduler_type` and `lr_scheduler_kwargs`.

Names and meanings are transformers' (`TrainingArguments.optim`, `get_scheduler`), which TRL's RLOOConfig inherits.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from rloo_engine.config_base import ConfigError

if TYPE_CHECKING:
    from rloo_engine.config import RLOOConfig

# Devices torch's fused AdamW kernel runs on (torch 2.13: CPU, CUDA, MPS, XPU).
_FUSED_ADAMW_DEVICES = {"cpu", "cuda", "mps", "xpu"}


def build_optimizer(cfg: RLOOConfig, params: list[torch.nn.Parameter],
                    say: Callable[[str], None] = print) -> torch.optim.Optimizer:
    """The optimizer `cfg.optim` names over the trainable `params`."""
    if cfg.optim == "adafactor":
        from transformers.optimization import Adafactor

        # As transformers' Trainer: a fixed learning rate the schedule drives, not Adafactor's own relative step.
        return Adafactor(params, lr=cfg.learning_rate, weight_decay=cfg.weight_decay, scale_parameter=False,
                         relative_step=False)
    fused = None
    if cfg.optim == "adamw_torch_fused":
        devices = {p.device.type for p in params}
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
