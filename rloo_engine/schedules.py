"""Which keyword arguments each transformers learning-rate schedule takes: the check of `lr_scheduler_kwargs` when a
config loads (imports nothing of the engine, so config.py can use it)."""

from __future__ import annotations

import inspect
from typing import Any

# Parameters every schedule function takes from the trainer, never from `lr_scheduler_kwargs`.
_SCHEDULE_ARGUMENTS = {"optimizer", "num_warmup_steps", "num_training_steps", "last_epoch"}
# transformers' get_scheduler calls these without the specific kwargs: a kwarg given for them would be dropped.
_SCHEDULES_WITHOUT_KWARGS = {"constant", "constant_with_warmup"}


def schedule_parameters(lr_scheduler_type: str) -> set[str]:
    """The keyword arguments `lr_scheduler_kwargs` may give the schedule `lr_scheduler_type`."""
    if lr_scheduler_type in _SCHEDULES_WITHOUT_KWARGS:
        return set()
    from transformers.optimization import TYPE_TO_SCHEDULER_FUNCTION, SchedulerType

    function = TYPE_TO_SCHEDULER_FUNCTION[SchedulerType(lr_scheduler_type)]
    return set(inspect.signature(function).parameters) - _SCHEDULE_ARGUMENTS


def check_scheduler_kwargs(lr_scheduler_type: str, kwargs: dict[str, Any]) -> None:
    """Raises ValueError naming a key of `lr_scheduler_kwargs` the schedule does not take (transformers would raise
    a TypeError at the first step, or silently drop it for the constant schedules)."""
    if not kwargs:
        return
    try:
        accepted = schedule_parameters(lr_scheduler_type)
    except (KeyError, ValueError):
        return  # an unknown lr_scheduler_type is reported by its own check
    unknown = sorted(set(kwargs) - accepted)
    if unknown:
        expected = f"some of {sorted(accepted)}" if accepted else "no keyword arguments ({})"
        raise ValueError(f"lr_scheduler_kwargs: {kwargs} has {unknown}, which lr_scheduler_type "
                         f"{lr_scheduler_type!r} does not take; expected {expected}")
