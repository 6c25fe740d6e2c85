"""Builds one generation batch: sample G completions per prompt, score them, compute KL and advantages.

This is the only place where a batch is assembled; the trainer then slices it into micro-batches.
"""

from __future__ import annotations

import contextlib
from dataclasses import asdict, dataclass
from typing import Any

import torch

from rloo_engine import algorithm as A
from rloo_engine.logprobs import HeadInput, chunkable_head, chunked_token_log_probs


@dataclass
class GenerationBatch:
    """Everything the loss needs for N = num_prompts * G completions on this process.

    input_ids, attention_mask: (N, P + T) prompt then completion; completion_mask: (N, T);
    advantages: (N,); loss_weights: (N,) 0 for rows excluded from the loss;
    old_token_logps: (N, T) sampling-policy log-probs, None when fully on-policy.
    loss_normalizer: live rows per micro-batch, averaged over the batch; each micro-batch's loss is
    divided by it, so every live row weighs the same whichever micro-batch it falls in.
    generator_logps: (N, T) the external generator's (vLLM's) log-probs of the sampled tokens, None with HF.
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

    def micro_batch(self, index: int, size: int) -> dict[str, Any]:
        rows = slice(index * size, (index + 1) * size)
        out = {k: v[rows] for k, v in asdict(self).items() if isinstance(v, torch.Tensor)}
        for optional in ("old_token_logps", "generator_logps"):
            value = getattr(self, optional)
            out[optional] = value[rows] if value is not None else None
        out["prompt_length"] = self.prompt_length
        out["loss_normalizer"] = self.loss_normalizer
        return out

    def state_dict(self) -> dict[str, Any]:
        return {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in asdict(self).items()}

    @classmethod
    def from_state_dict(cls, state: dict[str, Any], device: torch.device) -> GenerationBatch:
        return cls(**{k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in state.items()})


def completion_token_logps(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    prompt_length: int,
    temperature: float,
    with_entropy: bool = False,
    chunked: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probs of the completion part. input_ids, attention_mask: (B, P + T) -> (B, T) each.

    Only the T completion positions reach the LM head (`logits_to_keep`), so the prompt never costs a
    vocabulary-sized projection. With `chunked` (and a head it can reproduce, see `logprobs.py`) the
    head runs in chunks of positions and the (B, T, V) logits never exist.
    """
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    completion_len = input_ids.size(1) - prompt_length
    tokens = input_ids[:, prompt_length:]
    head = chunkable_head(model) if chunked else None
    kwargs = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                  logits_to_keep=completion_len + 1, use_cache=False)
    if head is None:
        logits = model(**kwargs).logits[:, :-1]  # position t predicts token t + 1
        return A.token_log_probs(logits, tokens, temperature, with_entropy)
    with HeadInput(head) as captured:
        model(**kwargs)
    return chunked_token_log_probs(captured.hidden[:, :-1], head, tokens, temperature, with_entropy)


@torch.no_grad()
def chunked_head_difference(model: torch.nn.Module, autocast=contextlib.nullcontext) -> float | None:
    """Max |log-prob difference| between the chunked path and the model's own logits on a fixed probe batch (two
    rows of 8 tokens, no RNG used), or None when the head is not one the chunked path can run at all. A model that
    transforms its logits after the head (a multiplier, soft-capping, a scale under a name nobody listed) shows
    up here, not only the ones `logprobs.chunkable_head` knows by name."""
    head = chunkable_head(model)
    if head is None:
        return None
    vocab = head.weight.shape[0]
    ids = (torch.arange(16, device=head.weight.device) * 7919 % vocab).view(2, 8)
    mask = torch.ones_like(ids)
    was_training = model.training
    model.eval()
    try:
        with autocast():
            full, _ = completion_token_logps(model, ids, mask, 4, 1.0, chunked=False)
            chunked, _ = completion_token_logps(model, ids, mask, 4, 1.0, chunked=True)
    finally:
        model.train(was_training)
    return (full.float() - chunked.float()).abs().max().item()


@torch.no_grad()
def batched_token_logps(model, input_ids, attention_mask, prompt_length, temperature, batch_size,
                        chunked: bool = False) -> torch.Tensor:
    """No-grad `completion_token_logps` over a whole generation batch, `batch_size` rows at a time."""
    parts = [
        completion_token_logps(model, input_ids[i : i + batch_size], attention_mask[i : i + batch_size],
                               prompt_length, temperature, chunked=chunked)[0]
        for i in range(0, input_ids.size(0), batch_size)
    ]
    return torch.cat(parts)


def group_reward_std(rewards: torch.Tensor, num_generations: int) -> torch.Tensor:
    """Std of rewards within each prompt's group. rewards: (P * G,) -> (P,)."""
    return rewards.view(-1, num_generations).std(-1)


def completion_length_metrics(completion_mask: torch.Tensor, terminated: torch.Tensor) -> dict[str, float]:
    """TRL's `completions/*` metrics for one generation batch. completion_mask: (N, T); terminated: (N,)."""
    lengths = completion_mask.sum(-1).float()
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
