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
from rloo_engine.prompt_sharing import prompt_groups, shared_prompt_outputs


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
    share_prompts: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probs of the completion part. input_ids, attention_mask: (B, P + T) -> (B, T) each.

    Only the T completion positions reach the LM head (`logits_to_keep`), so the prompt never costs a
    vocabulary-sized projection. With `chunked` (and a head it can reproduce, see `logprobs.py`) the
    head runs in chunks of positions and the (B, T, V) logits never exist. With `share_prompts`, adjacent rows
    with the same prompt share one forward of it (`prompt_sharing.py`).
    """
    tokens = input_ids[:, prompt_length:]
    head = chunkable_head(model) if chunked else None
    out = _completion_outputs(model, _run_to_head(head), input_ids, attention_mask, prompt_length, share_prompts)
    if head is None:
        return A.token_log_probs(out, tokens, temperature, with_entropy)
    return chunked_token_log_probs(out, head, tokens, temperature, with_entropy)


def _completion_outputs(model, run, input_ids, attention_mask, prompt_length: int, share_prompts: bool):
    """`run`'s output (logits, or the head's input) at the T positions that predict the completion tokens."""
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    groups = (prompt_groups(input_ids[:, :prompt_length], attention_mask[:, :prompt_length])
              if share_prompts and prompt_length > 1 else None)
    if groups is None:
        completion_len = input_ids.size(1) - prompt_length
        return run(model, input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                   logits_to_keep=completion_len + 1, use_cache=False)[:, :-1]  # position t predicts token t + 1
    return shared_prompt_outputs(model, run, input_ids, attention_mask, position_ids, prompt_length, groups)


def _run_to_head(head: torch.nn.Linear | None):
    """A forward that returns the logits, or with a chunkable `head` the hidden states that reach it."""
    def logits(model, **kwargs) -> torch.Tensor:
        return model(**kwargs).logits

    def hidden(model, **kwargs) -> torch.Tensor:
        with HeadInput(head) as captured:
            model(**kwargs)
        return captured.hidden

    return logits if head is None else hidden


@torch.no_grad()
def chunked_head_difference(model: torch.nn.Module, autocast=contextlib.nullcontext) -> float | None:
    """Max |log-prob difference| between the chunked path and the model's own logits on a fixed probe batch (two
    rows of 8 tokens, no RNG used), or None when the head is not one the chunked path can run at all. A model that
    transforms its logits after the head (a multiplier, soft-capping, a scale under a name nobody listed) shows
    up here, not only the ones `logprobs.chunkable_head` knows by name."""
    head = chunkable_head(model)
    if head is None:
        return None
    return _probe_difference(model, autocast, head.weight.shape[0], head.weight.device, chunked=True)


@torch.no_grad()
def shared_prompt_difference(model: torch.nn.Module, vocab_size: int, autocast=contextlib.nullcontext) -> float:
    """Max |log-prob difference| between `share_prompts` and the plain forward on a fixed probe batch of two
    prompts, two completions each: a model whose cache or masks the shared path does not fit shows up here."""
    device = next(model.parameters()).device
    return _probe_difference(model, autocast, vocab_size, device, rows=4, share_prompts=True)


def _probe_difference(model, autocast, vocab: int, device, rows: int = 2, **variant) -> float:
    ids = (torch.arange(rows * 8, device=device) * 7919 % vocab).view(rows, 8)
    ids[:, :4] = ids[torch.arange(rows, device=device) // 2 * 2, :4]  # rows 2k and 2k+1 share their 4-token prompt
    mask = torch.ones_like(ids)
    was_training = model.training
    model.eval()
    try:
        with autocast():
            plain, _ = completion_token_logps(model, ids, mask, 4, 1.0)
            other, _ = completion_token_logps(model, ids, mask, 4, 1.0, **variant)
    finally:
        model.train(was_training)
    return (plain.float() - other.float()).abs().max().item()


@contextlib.contextmanager
def frozen(model: torch.nn.Module):
    """`model`'s parameters with requires_grad off, restored after. Under no_grad that changes no value, but
    `torch.matmul` picks its kernel path (folding a (B, 1, H) input into one mm or not) by its operands'
    requires_grad, so a trainable policy and its frozen reference copy could round the same input differently
    (a KL of 1e-7 between identical models on some CPUs)."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    for p in trainable:
        p.requires_grad_(False)
    try:
        yield model
    finally:
        for p in trainable:
            p.requires_grad_(True)


@torch.no_grad()
def batched_token_logps(model, input_ids, attention_mask, prompt_length, temperature, batch_size,
                        chunked: bool = False, share_prompts: bool = False) -> torch.Tensor:
    """No-grad `completion_token_logps` over a whole generation batch, `batch_size` rows at a time, with the
    kernels a frozen model gets (`frozen`)."""
    with frozen(model):
        parts = [
            completion_token_logps(model, input_ids[i : i + batch_size], attention_mask[i : i + batch_size],
                                   prompt_length, temperature, chunked=chunked, share_prompts=share_prompts)[0]
            for i in range(0, input_ids.size(0), batch_size)
        ]
    return torch.cat(parts)


@torch.no_grad()
def batched_truncated_token_logps(model, input_ids, attention_mask, prompt_length, temperature, batch_size,
                                  truncation: dict, share_prompts: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """`batched_token_logps` (without the chunked head: the truncation needs each position's whole distribution)
    and, from the same forward, each completion position's `A.sampling_kept_log_mass` under `truncation`
    ({top_k, top_p, min_p}, vLLM's order). Returns ((N, T), (N, T)) float32."""
    tokens = input_ids[:, prompt_length:]
    logps, kept = [], []
    with frozen(model):
        for i in range(0, input_ids.size(0), batch_size):
            rows = slice(i, i + batch_size)
            logits = _completion_outputs(model, _run_to_head(None), input_ids[rows], attention_mask[rows],
                                         prompt_length, share_prompts)
            logps.append(A.token_log_probs(logits, tokens[rows], temperature)[0])
            kept.append(torch.stack([A.sampling_kept_log_mass(row.float() / temperature, **truncation)
                                     for row in logits]))  # a (T, V) slice at a time, as token_log_probs
    return torch.cat(logps), torch.cat(kept)


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
