"""One generation batch as the loss consumes it (`GenerationBatch`, sliced into micro-batches and saved with a
checkpoint), and the per-batch metrics TRL logs for it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from rloo_engine.vision import VisionRows


@dataclass
class GenerationBatch:
    """Everything the loss needs for N = num_prompts * G completions on this process.

    input_ids, attention_mask: (N, P + T) prompt then completion; completion_mask: (N, T);
    advantages: (N,); loss_weights: (N,) 0 for rows excluded from the loss;
    old_token_logps: (N, T) sampling-policy log-probs, None when fully on-policy.
    loss_normalizer: live rows per micro-batch, averaged over the batch; each micro-batch's loss is
    divided by it, so every live row weighs the same whichever micro-batch it falls in.
    generator_logps: (N, T) the external generator's (vLLM's) log-probs of the sampled tokens, None with HF.
    vision: the rows' pixel inputs (`vision.VisionRows`), with a vision-language model.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    completion_mask: torch.Tensor
    advantages: torch.Tensor
    loss_weights: torch.Tensor
    old_token_logps: torch.Tensor | None
    prompt_length: int
    loss_normalizer: float = 1.0
    generator_logps: torch.Tensor | None = None
    vision: VisionRows | None = None

    def micro_batch(self, index: int, size: int) -> dict[str, Any]:
        rows = slice(index * size, (index + 1) * size)
        # Not dataclasses.asdict: it deep-copies every tensor of the batch (and would turn `vision` into a dict).
        fields = {k: getattr(self, k) for k in self.__dataclass_fields__}
        out = {k: v[rows] for k, v in fields.items() if isinstance(v, torch.Tensor)}
        out["vision"] = None if self.vision is None else self.vision.rows(rows)
        for optional in ("old_token_logps", "generator_logps"):
            value = getattr(self, optional)
            out[optional] = value[rows] if value is not None else None
        out["prompt_length"] = self.prompt_length
        out["loss_normalizer"] = self.loss_normalizer
        return out

    def state_dict(self) -> dict[str, Any]:
        state = {k: getattr(self, k) for k in self.__dataclass_fields__}
        state["vision"] = None if self.vision is None else self.vision.to("cpu").state_dict()
        return {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in state.items()}

    @classmethod
    def from_state_dict(cls, state: dict[str, Any], device: torch.device) -> GenerationBatch:
        vision = state.get("vision")
        state = {**state, "vision": None if vision is None else VisionRows(**vision).to(device)}
        return cls(**{k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in state.items()})


def group_reward_std(rewards: torch.Tensor, num_generations: int) -> torch.Tensor:
    """Std of rewards within each prompt's group. rewards: (P * G,) -> (P,)."""
    return rewards.view(-1, num_generations).std(-1)


def completion_length_metrics(lengths: torch.Tensor, terminated: torch.Tensor) -> dict[str, float]:
    """TRL's `completions/*` metrics for one generation batch. lengths: (N,) completion tokens; terminated: (N,)."""
    lengths = lengths.float()
    done = lengths[terminated]
    return {
        "completions/mean_length": lengths.mean().item(),
        "completions/min_length": lengths.min().item(),
        "completions/max_length": lengths.max().item(),
        "completions/clipped_ratio": (~terminated).float().mean().item(),
        "completions/mean_terminated_length": done.mean().item() if done.numel() else 0.0,
        "completions/min_terminated_length": done.min().item() if done.numel() else 0.0,
        "completions/max_terminated_length": done.max().item() if done.numel() else 0.0,
    }


def generation_metrics(scored, rewards: torch.Tensor, valid: torch.Tensor, kl: torch.Tensor, token_kl_mean: float,
                       rollout, num_generations: int) -> dict[str, float]:
    """TRL's per-batch metrics: rewards (over scorable rows), each source's, KL, tokens, completion lengths.

    scored: `reward_sources.RewardResult`; rewards, valid, kl: (N,); rollout: the batch's `Rollout`."""
    metrics = {
        "reward": rewards[valid].mean().item() if valid.any() else float("nan"),
        "reward_std": rewards[valid].std().item() if valid.sum() > 1 else 0.0,
        "frac_reward_zero_std": (group_reward_std(rewards, num_generations) < 1e-6).float().mean().item(),
        "frac_unscorable": (~valid).float().mean().item(),
        "kl": token_kl_mean,
        "sequence_kl": kl.mean().item(),
        "num_tokens": float(rollout.prompt_mask.sum() + rollout.completion_mask.sum()),
    }
    for j, name in enumerate(scored.names):
        col = scored.per_source[:, j]
        col = col[~torch.isnan(col)]
        metrics[f"rewards/{name}/mean"] = col.mean().item() if col.numel() else float("nan")
        metrics[f"rewards/{name}/std"] = col.std().item() if col.numel() > 1 else 0.0
    return {**metrics, **completion_length_metrics(rollout.completion_mask.sum(-1), rollout.terminated)}
