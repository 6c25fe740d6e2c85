"""What a reward function gets besides the batch, as TRL passes it: `trainer_state`, `log_extra` and `log_metric`;
and the merge of what it logged over the processes, once per generation batch.

TRL 1.16 (`RLOOTrainer._calculate_rewards`) calls every reward function with `trainer_state=self.state` (the HF
`TrainerState`), `log_extra(column, values)` (extra columns for the completions table) and `log_metric(name, value)`
(a scalar logged under `name` beside `kl` and `entropy`). After scoring it merges what was logged over the
processes: each metric's batch value is the sum of every process's values over their count, and a column one
process did not log is None in its rows.
"""

from __future__ import annotations

import math
import sys
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from numbers import Real
from typing import Any

import torch
from transformers import TrainerState

from rloo_engine.config import RLOOConfig
from rloo_engine.reward_sources import RewardError

# Columns every completions row already has; `log_extra` may not overwrite them.
COMPLETION_COLUMNS = ("step", "prompt", "completion", "reward", "advantage")


class RewardLogError(RewardError):
    """A reward function logged something unusable through `log_extra` / `log_metric`; the message names it."""


def new_trainer_state(cfg: RLOOConfig, dataset_size: int | None, num_processes: int, is_local_main: bool,
                      is_main: bool) -> TrainerState:
    """transformers' `TrainerState` with the run's fields filled as the HF Trainer fills them. The trainer sets
    `global_step` (optimizer steps done) and `epoch` (as logged) before each reward call, and appends each logged
    row to `log_history` (a resumed run reloads it from its checkpoint), through `RewardContext`.
    `dataset_size` None: a stream (IterableDataset), whose epochs the HF Trainer counts as `sys.maxsize`."""
    total_steps = cfg.total_steps_for(dataset_size or 1, num_processes)
    steps_per_epoch = cfg.model_copy(update={"max_steps": -1, "num_train_epochs": 1.0}).total_steps_for(
        dataset_size or 1, num_processes)
    return TrainerState(
        max_steps=total_steps,
        num_train_epochs=math.ceil(total_steps / steps_per_epoch) if dataset_size else sys.maxsize,
        logging_steps=cfg.logging_steps,
        eval_steps=cfg.eval_interval(total_steps, cfg.logging_steps),  # logging_steps unless set, as the HF Trainer
        save_steps=cfg.save_steps,
        train_batch_size=cfg.per_device_train_batch_size,
        is_local_process_zero=is_local_main,
        is_world_process_zero=is_main,
        log_history=[],
    )


@dataclass
class RewardLogs:
    """What the reward functions of one generation batch logged on this process."""

    extra: dict[str, list] = field(default_factory=lambda: defaultdict(list))
    metrics: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))

    def log_extra(self, column: str, values: list) -> None:
        """TRL's `log_extra`: one value per completion of the batch, shown as `column` in the completions table."""
        if column in COMPLETION_COLUMNS:
            raise RewardLogError(f"log_extra: column {column!r} is one the completions table already has "
                                 f"{list(COMPLETION_COLUMNS)}; name it otherwise")
        self.extra[column].extend(values)

    def log_metric(self, name: str, value: float) -> None:
        """TRL's `log_metric`: one scalar for this batch, logged as `name` (averaged over the logging window)."""
        if isinstance(value, torch.Tensor):
            value = value.item()
        if not isinstance(value, Real):
            raise RewardLogError(f"log_metric: {name!r} got a {type(value).__name__}; expected a float")
        self.metrics[name].append(float(value))

    def kwargs(self) -> dict[str, Callable]:
        return {"log_extra": self.log_extra, "log_metric": self.log_metric}

    def merge(self, num_rows: int, gather_object: Callable[[list], list],
              gather: Callable[[torch.Tensor], torch.Tensor]) -> tuple[dict[str, list], dict[str, float]]:
        """(this process's extra columns, each `num_rows` long, None where it logged none; each metric's value
        over all processes), then clears. Every process must call it: the names are gathered first, so each
        process sends the same metrics in the same order (TRL sorts them for the same reason).

        gather_object: every process's list, concatenated; gather: every process's tensor, stacked on dim 0."""
        everyone = gather_object([(sorted(self.extra), sorted(self.metrics))])
        columns = sorted({c for extra, _ in everyone for c in extra})
        names = sorted({n for _, metrics in everyone for n in metrics})
        extra = {}
        for column in columns:
            values = self.extra.get(column, [None] * num_rows)
            if len(values) != num_rows:
                raise RewardLogError(f"log_extra: column {column!r} got {len(values)} values this generation batch; "
                                     f"expected {num_rows}, one per completion (logged once per batch)")
            extra[column] = list(values)
        metrics = {}
        if names:
            local = torch.tensor([[sum(self.metrics.get(n, [])), len(self.metrics.get(n, []))] for n in names],
                                 dtype=torch.float64)  # (K, 2): sum, count
            totals = gather(local).view(-1, len(names), 2).sum(0)  # (K, 2) over processes
            metrics = {n: (s / c if c else math.nan) for n, (s, c) in zip(names, totals.tolist())}
        self.extra.clear()
        self.metrics.clear()
        return extra, metrics


class RewardContext:
    """One trainer's `trainer_state` and `RewardLogs`, and the collectives that merge the logs over its processes."""

    def __init__(self, cfg: RLOOConfig, dataset_size: int | None, acc: Any):
        from accelerate.utils import gather_object

        self.state = new_trainer_state(cfg, dataset_size, acc.num_processes, acc.is_local_main_process,
                                       acc.is_main_process)
        self.logs = RewardLogs()
        self._gather_object = gather_object
        self._gather = lambda t: acc.gather(t.to(acc.device)).cpu()

    def kwargs(self, global_step: int, epoch: float) -> dict[str, Any]:
        """The reward call's extra keyword arguments, the state at `global_step` optimizer steps done."""
        self.state.global_step, self.state.epoch = global_step, epoch
        return reward_kwargs(self.state, self.logs)

    def merge(self, num_rows: int) -> tuple[dict[str, list], dict[str, float]]:
        """`RewardLogs.merge` over the trainer's processes; every process calls it once per generation batch."""
        return self.logs.merge(num_rows, self._gather_object, self._gather)

    def logged(self, step: int, metrics: dict[str, float]) -> None:
        """A logged row, kept in `trainer_state.log_history` as the HF Trainer keeps it."""
        self.state.log_history.append({**metrics, "step": step})


def reward_kwargs(state: TrainerState, logs: RewardLogs) -> dict[str, Any]:
    """The keyword arguments TRL adds to every reward call beside the batch and the dataset columns."""
    return {"trainer_state": state, **logs.kwargs()}


def standalone_reward_kwargs() -> dict[str, Any]:
    """The same outside training (the pipeline's reward probe): a step-0 state, and logs that go nowhere."""
    return reward_kwargs(TrainerState(log_history=[]), RewardLogs())
