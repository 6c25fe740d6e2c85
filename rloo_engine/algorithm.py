"""The RLOO math (Ahmadian et al. 2024) as small pure tensor functions: no I/O, no config, no accelerate.

Notation: B sequences in a micro-batch, T completion tokens, V vocabulary, G completions per prompt,
N = num_prompts * G sequences in a generation batch. pi_theta is the policy being updated, pi_old the
sampling policy as the trainer computes it, mu the distribution an external generator (vLLM) sampled from.
"""

from __future__ import annotations

import math

import torch

IMPORTANCE_SAMPLING_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def token_log_probs(
    logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0, with_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probability of each sampled token under temperature-scaled logits.

    logits: (B, T, V), position t predicts tokens[:, t]; tokens: (B, T) int64.
    Returns (logps: (B, T) float32, entropy: (B, T) float32 or None).

    Works one sequence at a time. Without gradient (reference and old log-probs) only one (T, V)
    float32 slice exists beside the logits at a time. With gradient, autograd saves every row's
    float32 scaled slice for the backward pass, so a (B, T, V) float32 copy does exist then (beside
    bf16 logits, twice their size): at 150k vocab it dominates the update's memory.
    Entropy is a metric only, so it is computed without gradient.
    """
    logps, entropies = [], []
    for row_logits, row_tokens in zip(logits, tokens):
        scaled = row_logits.float() / temperature  # (T, V): the one temporary
        log_norm = torch.logsumexp(scaled, dim=-1)  # (T,)
        logps.append(scaled.gather(-1, row_tokens.unsqueeze(-1)).squeeze(-1) - log_norm)
        if with_entropy:
            with torch.no_grad():
                probs = torch.softmax(scaled, dim=-1)
                entropies.append(log_norm - (probs * scaled).sum(-1))
    entropy = torch.stack(entropies) if with_entropy else None
    return torch.stack(logps), entropy


def sequence_log_probs(token_logps: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sum of token log-probs over real completion tokens.

    token_logps: (B, T); mask: (B, T) 1 for completion tokens up to and including the first EOS.
    Returns (B,).
    """
    return (token_logps * mask).sum(-1)


def sequence_kl(policy_token_logps: torch.Tensor, ref_token_logps: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """k1 estimate of KL(pi || pi_ref) for each sampled sequence: sum_t log pi(o_t) - log pi_ref(o_t).

    All inputs (B, T); returns (B,). An unbiased single-sample estimate of the sequence KL.
    """
    return ((policy_token_logps - ref_token_logps) * mask).sum(-1)


def kl_penalized_rewards(rewards: torch.Tensor, kl: torch.Tensor, beta: float) -> torch.Tensor:
    """RLOO's reward, r_i = R(o_i) - beta * KL_i: the KL to the reference lowers the reward of a completion.

    rewards, kl: (N,) with kl the sequence log-ratio to the reference (no gradient); returns (N,).
    """
    return rewards - beta * kl


def leave_one_out_advantages(rewards: torch.Tensor, num_generations: int, valid: torch.Tensor | None = None) -> torch.Tensor:
    """A_i = r_i - mean of the other valid rewards of the same prompt.

    rewards: (num_prompts * G,), grouped so rows [k*G, (k+1)*G) share a prompt.
    valid: (num_prompts * G,) bool; invalid (unscorable) rows are left out of every baseline and get
    advantage 0. A valid row with no other valid row in its group has no baseline and gets 0 too.
    Returns (num_prompts * G,) in the dtype of `rewards`.
    """
    if valid is None:
        valid = torch.ones_like(rewards, dtype=torch.bool)
    r = torch.where(valid, rewards, torch.zeros_like(rewards)).view(-1, num_generations)  # (P, G)
    v = valid.view(-1, num_generations).to(rewards.dtype)  # (P, G)
    others = (v.sum(-1, keepdim=True) - v).clamp(min=1)  # valid rows besides i
    baseline = (r.sum(-1, keepdim=True) - r) / others
    has_baseline = (v.sum(-1, keepdim=True) - v) > 0
    advantages = torch.where((v > 0) & has_baseline, r - baseline, torch.zeros_like(r))
    return advantages.view(-1)


def normalize_advantages(
    advantages: torch.Tensor,
    valid: torch.Tensor,
    pooled_advantages: torch.Tensor | None = None,
    pooled_valid: torch.Tensor | None = None,
    eps: float = 1e-4,
) -> torch.Tensor:
    """(A - mean) / (std + eps), mean and std over the valid rows of the pool; invalid rows stay 0.

    advantages, valid: (N,) this process's rows. pooled_*: (M,) the rows the statistics come from,
    e.g. every process's batch gathered (TRL normalises over the whole gathered batch); default: these.
    Returns (N,).
    """
    if pooled_advantages is None:
        pooled_advantages, pooled_valid = advantages, valid
    pool = pooled_advantages[pooled_valid]
    if pool.numel() < 2:
        return advantages
    normalized = (advantages - pool.mean()) / (pool.std() + eps)
    return torch.where(valid, normalized, torch.zeros_like(advantages))


def clipped_sequence_loss(
    seq_logps: torch.Tensor,
    old_seq_logps: torch.Tensor,
    advantages: torch.Tensor,
    epsilon_low: float,
    epsilon_high: float,
    weights: torch.Tensor | None = None,
    normalizer: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """-sum_i w_i min(rho_i A_i, clip(rho_i, 1 - eps_low, 1 + eps_high) A_i) / normalizer, rho_i = pi_theta / pi_old.

    seq_logps: (B,) with gradient; old_seq_logps, advantages: (B,) without.
    weights: (B,) 1 for sequences in the loss, 0 for excluded ones (e.g. masked truncations).
    normalizer: what the weighted sum is divided by; None = this micro-batch's weight sum (a mean over
    its live rows). The trainer passes the live rows per micro-batch averaged over the whole batch, so
    a row whose neighbours were masked does not weigh more than any other row of the optimizer step.
    Returns (loss: scalar, ratio: (B,) detached). On-policy old == current, so rho = 1 and the
    gradient is plain REINFORCE with the leave-one-out baseline.
    """
    ratio = torch.exp(seq_logps - old_seq_logps)
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
    objective = torch.minimum(ratio * advantages, clipped * advantages)
    if weights is None:
        weights = torch.ones_like(objective)
    denominator = weights.sum().clamp(min=1) if normalizer is None else normalizer
    loss = -(objective * weights).sum() / denominator
    return loss, ratio.detach()


def sampling_kept_log_mass(scaled_logits: torch.Tensor, top_k: int | None = None, top_p: float = 1.0,
                           min_p: float | None = None) -> torch.Tensor:
    """log of the probability mass that truncated sampling keeps at each position, as vLLM's sampler truncates.

    scaled_logits: (..., V) logits already divided by the temperature. Returns (...) float32 <= 0, exactly 0
    where nothing is truncated. vLLM masks in this order: min_p (tokens below min_p times the top probability),
    then top_k (ties with the k-th value kept), then top_p over what is left, renormalised (the smallest tokens
    go while the mass below them is at most 1 - top_p; the top token always stays). Its processed log-probs are
    of that renormalised distribution: log mu_trunc(o) = log mu(o) - kept_log_mass, which is how the trainer puts
    them on the scale of its own full-distribution log-probs (`vllm_truncation` in docs/architecture.md).
    """
    log_probs = scaled_logits.float().log_softmax(-1)
    keep = torch.ones_like(log_probs, dtype=torch.bool)
    if min_p:
        keep &= log_probs >= log_probs.amax(-1, keepdim=True) + math.log(min_p)
    if top_k and top_k < log_probs.size(-1):
        keep &= log_probs >= log_probs.masked_fill(~keep, -math.inf).topk(top_k, dim=-1).values[..., -1:]
    if top_p < 1.0:
        kept = log_probs.masked_fill(~keep, -math.inf).log_softmax(-1)
        sorted_logps, order = kept.sort(dim=-1)  # ascending, as vLLM's top-p
        below = sorted_logps.exp().cumsum(-1) <= 1 - top_p
        below[..., -1] = False
        keep &= ~torch.zeros_like(below).scatter(-1, order, below)
    kept_log_mass = torch.logsumexp(log_probs.masked_fill(~keep, -math.inf), dim=-1)
    return kept_log_mass.masked_fill(keep.all(-1), 0.0)  # exactly 0, not logsumexp's rounding of log 1


def logprob_difference_stats(trainer_logps: torch.Tensor, generator_logps: torch.Tensor,
                             mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """Mean and max of |log pi_old(o_t) - log mu(o_t)| over real completion tokens (TRL's sampling_logp_difference).

    All inputs (B, T); returns scalar tensors `mean`, `max` (NaN when the mask is empty).
    """
    delta = (trainer_logps.detach() - generator_logps).abs()[mask.bool()]
    if delta.numel() == 0:
        nan = torch.tensor(float("nan"), device=delta.device)
        return {"mean": nan, "max": nan}
    return {"mean": delta.mean(), "max": delta.max()}


@torch.no_grad()
def generator_importance_weights(
    trainer_logps: torch.Tensor,
    generator_logps: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    clip_min: float | None,
    clip_max: float | None,
) -> torch.Tensor:
    """Truncated or masked importance weights pi_old / mu, correcting for sampling from mu instead of pi_old.

    trainer_logps, generator_logps, mask: (B, T). Returns, without gradient:
    token_* modes (B, T): w_t = pi_old(o_t) / mu(o_t), 0 where masked;
    sequence_* modes (B, 1): w = prod_t pi_old(o_t) / mu(o_t) over the real tokens.
    *_truncate clamps the ratio to [clip_min, clip_max]; *_mask sets a ratio outside them to 0 (TRL's GRPO).
    A bound of None is no bound. With pi_old == mu every weight is exactly 1.
    """
    if mode not in IMPORTANCE_SAMPLING_MODES:
        raise ValueError(f"mode: {mode!r}; expected one of {IMPORTANCE_SAMPLING_MODES}")
    log_ratio = (trainer_logps - generator_logps) * mask
    if mode.startswith("sequence"):
        log_ratio = log_ratio.sum(-1, keepdim=True)
    ratio = torch.exp(log_ratio)
    if mode.endswith("truncate"):
        ratio = torch.clamp(ratio, min=clip_min, max=clip_max)
    else:
        low = -math.inf if clip_min is None else clip_min
        high = math.inf if clip_max is None else clip_max
        ratio = ratio.masked_fill((ratio < low) | (ratio > high), 0.0)
    return ratio * mask if mode.startswith("token") else ratio


def importance_weighted_sequence_log_probs(token_logps: torch.Tensor, weights: torch.Tensor,
                                           mask: torch.Tensor) -> torch.Tensor:
    """sum_t log pi_theta(o_t) in value, sum_t w_t grad log pi_theta(o_t) in gradient.

    token_logps: (B, T) with gradient; weights: (B, T) or (B, 1) without (`generator_importance_weights`);
    mask: (B, T). Returns (B,), bit-equal in value to `sequence_log_probs`, so the sequence ratio rho and its
    clip are unchanged. Through rho = exp(sum - old) the unclipped gradient of rho_i A_i becomes
    rho_i A_i sum_t w_t grad log pi_theta(o_t): each token's score-function term weighted by its own
    importance weight (token modes) or every term by the sequence's (sequence modes, the same as
    multiplying the sequence's objective by w).
    """
    detached = token_logps.detach()
    return ((detached + weights * (token_logps - detached)) * mask).sum(-1)


def vllm_anchor_masks(weights: torch.Tensor, mask: torch.Tensor,
                      row_weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The token mask and row weights of a ratio taken against vLLM's log-probs (`ratio_anchor: vllm`).

    weights: (B, T) or (B, 1) from `generator_importance_weights` in a *_mask mode; mask: (B, T);
    row_weights: (B,). A token (token_mask) or completion (sequence_mask) whose weight was masked to 0 drops
    out of both sequence sums, and a completion with no token left drops out of the loss, so it adds neither
    gradient nor a ratio of exp(0) = 1 to the clip metrics. Returns (mask (B, T), row_weights (B,)).
    """
    kept = mask * (weights > 0)
    return kept, row_weights * (kept.sum(-1) > 0)


def importance_weight_stats(weights: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """min / mean / max of importance weights: over real tokens for (B, T) weights, over rows for (B, 1).

    TRL's `sampling/importance_sampling_ratio/{min,mean,max}`. Returns scalar tensors (NaN when empty).
    """
    values = weights[mask.bool()] if weights.shape == mask.shape else weights.flatten()
    if values.numel() == 0:
        nan = torch.tensor(float("nan"), device=weights.device)
        return {"min": nan, "mean": nan, "max": nan}
    return {"min": values.min(), "mean": values.mean(), "max": values.max()}


def clip_ratio_metrics(
    ratio: torch.Tensor, advantages: torch.Tensor, epsilon_low: float, epsilon_high: float, weights: torch.Tensor | None = None
) -> dict[str, torch.Tensor]:
    """Fraction of sequences whose gradient the clip removed, TRL-style.

    low: ratio < 1 - eps_low with A < 0; high: ratio > 1 + eps_high with A > 0; region: either.
    All inputs (B,); returns scalar tensors `low`, `high`, `region` (means over weighted rows).
    """
    if weights is None:
        weights = torch.ones_like(ratio)
    denom = weights.sum().clamp(min=1)
    low = ((ratio < 1 - epsilon_low) & (advantages < 0)).float()
    high = ((ratio > 1 + epsilon_high) & (advantages > 0)).float()
    return {
        "low": (low * weights).sum() / denom,
        "high": (high * weights).sum() / denom,
        "region": (((low + high) > 0).float() * weights).sum() / denom,
    }


def completion_mask(completion_ids: torch.Tensor, eos_token_id: int | list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Mask tokens after the first EOS.

    completion_ids: (B, T). Returns (mask: (B, T) int64, 1 up to and including the first EOS;
    terminated: (B,) bool, whether an EOS was produced within T tokens).
    """
    eos_ids = torch.as_tensor(eos_token_id if isinstance(eos_token_id, list) else [eos_token_id], device=completion_ids.device)
    is_eos = torch.isin(completion_ids, eos_ids)
    terminated = is_eos.any(-1)
    T = completion_ids.size(1)
    first_eos = torch.where(terminated, is_eos.int().argmax(-1), torch.full_like(terminated, T, dtype=torch.long))
    positions = torch.arange(T, device=completion_ids.device).expand_as(completion_ids)
    return (positions <= first_eos.unsqueeze(-1)).long(), terminated
