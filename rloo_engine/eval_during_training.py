"""Evaluation during training, as TRL's RLOOTrainer runs it: every prompt of each eval dataset gets
`num_generations_eval` completions from the current policy, scored by the training reward sources, and TRL's
batch metrics are logged with an `eval_` prefix (`eval_<name>_` for each of a dict of eval datasets, the HF
Trainer's naming) plus `eval_runtime` and `eval_samples_per_second`.

Deterministic for a seed: each eval batch samples under its own seed (seed, step, batch, rank) in a forked RNG,
so evaluating never changes the training trajectory. Every process runs the same number of batches (the last
padded with a repeated prompt that no metric counts), since generation under ZeRO-3 and the gathers are
collective.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import torch

from rloo_engine.batch import completion_length_metrics, group_reward_std
from rloo_engine.data import as_assistant_messages, extra_columns, is_conversational


class PeriodicEvaluation:
    """When to evaluate (`due`) and one evaluation over every eval dataset (`run`)."""

    def __init__(self, datasets: dict[str, Any], cfg: Any, acc: Any, tokenizer: Any, render: Callable[[Any], str],
                 total_steps: int):
        self.datasets, self.cfg, self.acc, self.tokenizer, self.render = datasets, cfg, acc, tokenizer, render
        self.source_names: list[str] = []
        self.num_generations = cfg.eval_generations(cfg.num_generations)
        self.prompts_per_batch = cfg.per_device_eval_batch_size // self.num_generations
        self.interval = cfg.eval_interval(total_steps, cfg.logging_steps)

    def due(self, step: int, epoch_before: float, epoch_after: float) -> bool:
        """After optimizer step `step`: `eval_strategy: steps` every `eval_steps`, `epoch` when a pass over the
        training prompts ended during it; never before `eval_delay`."""
        if not self.datasets or step < self.cfg.eval_delay:
            return False
        if self.cfg.eval_strategy == "steps":
            return step % self.interval == 0
        return self.cfg.eval_strategy == "epoch" and math.floor(epoch_after) > math.floor(epoch_before)

    def run(self, step: int, generate: Callable, score: Callable, kl: Callable | None) -> dict[str, float]:
        """`generate(rendered, G, add_special_tokens) -> Rollout` with the current weights; `score(prompts,
        completions, completion_ids, columns) -> RewardResult`; `kl(rollout) -> (N,) summed token KL` or None
        without a reference (beta 0). Returns every eval metric of every dataset."""
        metrics: dict[str, float] = {}
        for name, dataset in self.datasets.items():
            start = time.perf_counter()
            rows = self._rows(step, dataset, generate, score, kl)
            prefix = f"eval_{name}_" if name else "eval_"
            values = self._metrics(rows)
            values["runtime"] = time.perf_counter() - start
            values["samples_per_second"] = len(dataset) * self.num_generations / values["runtime"]
            metrics.update({prefix + k: v for k, v in values.items()})
        return metrics

    def _rows(self, step: int, dataset: Any, generate, score, kl) -> dict[str, torch.Tensor]:
        """Per-completion results of this process's share of `dataset`, gathered from every process."""
        G, b, P = self.num_generations, self.prompts_per_batch, self.acc.num_processes
        parts: dict[str, list[torch.Tensor]] = {}
        for batch, first in enumerate(range(0, len(dataset), b * P)):
            mine = range(first + self.acc.process_index * b, first + (self.acc.process_index + 1) * b)
            real = torch.tensor([i < len(dataset) for i in mine]).repeat_interleave(G)  # (b*G,) padding rows off
            rows = [dataset[i if i < len(dataset) else 0] for i in mine]
            conversational = is_conversational(rows[0]["prompt"])
            seed = self.cfg.seed + 1_000_003 * (step + 1) + 7919 * batch + 104_729 * self.acc.process_index
            devices = [self.acc.device] if self.acc.device.type == "cuda" else []
            with torch.random.fork_rng(devices=devices):
                torch.manual_seed(seed)
                rollout = generate([self.render(r["prompt"]) for r in rows], G, not conversational)
            texts = self.tokenizer.batch_decode(rollout.completion_ids, skip_special_tokens=True)
            prompts = [r["prompt"] for r in rows for _ in range(G)]
            columns = {k: [v for v in col for _ in range(G)] for k, col in extra_columns(rows).items()}
            completions = [as_assistant_messages(t) for t in texts] if conversational else texts
            ids = [c[m.bool()].tolist() for c, m in zip(rollout.completion_ids, rollout.completion_mask)]
            scored = score(prompts, completions, ids, columns)
            self.source_names = scored.names
            lengths = rollout.completion_mask.sum(-1).float()
            row = {"real": real.float(), "reward": scored.rewards, "valid": scored.scorable.float(),
                   "per_source": scored.per_source, "length": lengths.cpu(), "terminated": rollout.terminated.float().cpu()}
            if kl is not None:
                row["kl"] = kl(rollout).float().cpu()
            for key, value in row.items():
                parts.setdefault(key, []).append(value.cpu())
        local = {k: torch.cat(v) for k, v in parts.items()}
        return {k: self.acc.gather(v.to(self.acc.device)).cpu() for k, v in local.items()}

    def _metrics(self, rows: dict[str, torch.Tensor]) -> dict[str, float]:
        real = rows["real"].bool()
        valid = real & rows["valid"].bool()
        rewards = rows["reward"]
        G = self.num_generations
        metrics = {
            "reward": rewards[valid].mean().item() if valid.any() else float("nan"),
            "reward_std": rewards[valid].std().item() if valid.sum() > 1 else 0.0,
            "frac_unscorable": (~valid[real]).float().mean().item(),
        }
        if G > 1:  # groups are whole: padding rows come in whole groups
            grouped = group_reward_std(rewards[real], G)
            metrics["frac_reward_zero_std"] = (grouped < 1e-6).float().mean().item()
        for j, name in enumerate(self.source_names):
            col = rows["per_source"][real][:, j]
            col = col[~torch.isnan(col)]
            metrics[f"rewards/{name}/mean"] = col.mean().item() if col.numel() else float("nan")
            metrics[f"rewards/{name}/std"] = col.std().item() if col.numel() > 1 else 0.0
        if "kl" in rows:  # TRL's `kl`: per completion token
            metrics["kl"] = (rows["kl"][real].sum() / rows["length"][real].sum().clamp(min=1)).item()
        return {**metrics, **completion_length_metrics(rows["length"][real], rows["terminated"][real].bool())}
