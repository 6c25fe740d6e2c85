"""The evaluation-during-training options of RLOOConfig, with TRL's (transformers') names: which prompts, when, and
how many completions. A mixin on the one config base; the trainer runs them (`eval_during_training.py`)."""

from __future__ import annotations

import math
from typing import Literal

from rloo_engine.config_base import F, StrictModel


class EvalOptions(StrictModel):
    """Generating and scoring held-out prompts while training, logged as `eval_*` beside the training metrics."""

    eval_strategy: Literal["no", "steps", "epoch"] = F(
        "no",
        "When to evaluate: `no`; `steps` (every `eval_steps` optimizer steps); `epoch` (at the end of each pass over "
        "the training prompts). Each evaluation generates `num_generations_eval` completions for every prompt of "
        "the eval dataset with the current policy, scores them with the reward sources and logs TRL's metric names "
        "with an `eval_` prefix (`eval_reward`, `eval_rewards/<name>/mean`, `eval_kl`, `eval_completions/*`, "
        "`eval_runtime`; `eval_<name>_...` for each of a dict of eval datasets). Needs an eval dataset: "
        "`RLOOTrainer(eval_dataset=...)`, or `dataset_test_split` of `dataset_name` from the command line.",
    )
    eval_steps: float | None = F(
        None,
        "Optimizer steps between evaluations with `eval_strategy: steps`; a value below 1 is a fraction of the "
        "run's steps (rounded up), as transformers reads it. None = `logging_steps`, transformers' default.",
        gt=0,
    )
    eval_delay: float = F(0, "Optimizer steps before the first evaluation (`eval_on_start` aside).", ge=0)
    eval_on_start: bool = F(
        False, "Evaluate once before the first optimizer step (logged at step 0); a resumed run does not repeat it.")
    per_device_eval_batch_size: int = F(
        8,
        "Completions (not prompts) generated and scored at a time per process during evaluation, as in TRL; a "
        "multiple of `num_generations_eval`.",
        ge=1,
    )
    num_generations_eval: int | None = F(
        None, "Completions per eval prompt; None = `num_generations`. 1 is allowed (no group statistics).", ge=1)
    dataset_test_split: str = F(
        "test",
        "Split of `dataset_name` evaluated when `eval_strategy` is not `no` and no eval dataset object is given "
        "(`rloo-engine train`), as `trl rloo` uses it.",
    )

    def eval_generations(self, num_generations: int) -> int:
        return self.num_generations_eval or num_generations

    def eval_interval(self, total_steps: int, logging_steps: int) -> int:
        """Optimizer steps between evaluations (`eval_strategy: steps`)."""
        if self.eval_steps is None:
            return logging_steps
        return max(1, math.ceil(self.eval_steps * total_steps)) if self.eval_steps < 1 else int(self.eval_steps)

    def _check_eval(self, num_generations: int) -> None:
        g = self.eval_generations(num_generations)
        if self.per_device_eval_batch_size % g:
            raise ValueError(
                f"per_device_eval_batch_size: {self.per_device_eval_batch_size} is not a multiple of "
                f"num_generations_eval={g}; each eval prompt's completions are generated together on one process"
            )
        if getattr(self, "async_generation", False) and (self.eval_strategy != "no" or self.eval_on_start):
            raise ValueError(f"eval_strategy: {self.eval_strategy!r} with async_generation: true; evaluating would "
                             "wait for or disturb the batch generating ahead on the server; evaluate without it")
        if self.eval_steps is not None and self.eval_steps >= 1 and self.eval_steps != int(self.eval_steps):
            raise ValueError(f"eval_steps: {self.eval_steps}; expected a whole number of steps, or a fraction below 1")
