"""transformers' `TrainerCallback`s in the engine's loop, called as the HF Trainer calls them: `on_init_end`,
`on_train_begin`, `on_step_begin`, `on_step_end`, `on_log`, `on_evaluate`, `on_save`, `on_train_end`, each with
(args = the RLOOConfig, state = the trainer's `TrainerState`, control, model=, processing_class=, optimizer=,
lr_scheduler=). A callback's `control.should_training_stop` ends the run after that step (its final model
saved), `should_save` writes a checkpoint at that step, `should_evaluate` evaluates, `should_log` logs."""

from __future__ import annotations

from typing import Any

import torch
from transformers import TrainerControl, TrainerState
from transformers.trainer_callback import CallbackHandler


class EngineCallbacks(CallbackHandler):
    """transformers' CallbackHandler without its DefaultFlowCallback: the loop itself decides when to log,
    evaluate and save (as its config says); callbacks add to that through `control`."""

    def __init__(self, callbacks: list, model: Any, processing_class: Any, optimizer: Any, lr_scheduler: Any):
        self.callbacks = []
        for callback in callbacks:
            self.add_callback(callback)
        self.model, self.processing_class = model, processing_class
        self.optimizer, self.lr_scheduler = optimizer, lr_scheduler
        self.train_dataloader = self.eval_dataloader = None
        self.control = TrainerControl()

    def event(self, name: str, args: Any, state: TrainerState, **kwargs: Any) -> TrainerControl:
        """Calls `name` on every callback (the handler's own `on_*` resets the flags it consumes, as HF's)."""
        if self.callbacks:
            self.control = getattr(self, name)(args, state, self.control, **kwargs)
        return self.control


def any_process(flag: bool, acc: Any) -> bool:
    """Whether `flag` is set on any process: a callback on rank 0 alone may stop or save the run, and every
    process must then do the same."""
    if acc.num_processes == 1:
        return flag
    return bool(acc.gather(torch.tensor([float(flag)], device=acc.device)).max().item())
