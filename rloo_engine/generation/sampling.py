"""Drawing each next token inside HF `generate` without `torch.multinomial`.

Why: on CPU, `torch.multinomial` over a (16, 32000) probability matrix takes ~16 ms per call, as long
as that decode step's whole LM-head matmul (bench/README.md). Inverse-CDF sampling in two levels
(pick a block of 256 tokens by its mass, then a token inside it) draws from the same distribution
in ~1 ms. HF `generate` samples with multinomial whenever `do_sample=True`, so the
backend runs it with `do_sample=False` and `TokenSampler` as the last logits processor: it applies
the same warpers HF would (temperature, top-k, top-p, min-p, in HF's order), draws the token, and
returns scores whose argmax is that token.
"""

from __future__ import annotations

import torch
from transformers import (
    LogitsProcessor,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

_BLOCK = 256

# generate kwargs that only add logits processors or stopping rules: they work the same under TokenSampler.
PROCESSOR_KWARGS = frozenset({
    "min_new_tokens", "min_length", "no_repeat_ngram_size", "bad_words_ids", "suppress_tokens",
    "begin_suppress_tokens", "forced_bos_token_id", "forced_eos_token_id", "sequence_bias", "stop_strings",
    "logits_processor", "stopping_criteria", "exponential_decay_length_penalty", "max_time",
})


def sample_categorical(probs: torch.Tensor, block: int = _BLOCK) -> torch.Tensor:
    """One draw per row of `probs` (B, V), non-negative, rows not necessarily normalised -> (B,) int64.

    Level 1 picks a block of `block` tokens by its mass (block sums in float32, about 1e-7 relative
    error; their cumulative sum and the draw in float64); level 2 picks the token inside it. Neither
    level copies the (B, V) matrix. Never returns a zero-probability index: each level takes the
    first entry whose cumulative mass exceeds a uniform draw kept strictly below the total. A row with
    NaN or inf, or no mass at all, raises ValueError naming the rows, as `torch.multinomial` refuses it.
    """
    probs = probs.contiguous()
    B, V = probs.shape
    full = V // block
    mass = [probs.as_strided((B, full, block), (V, block, 1)).sum(-1)] if full else []
    if V % block:
        mass.append(probs[:, full * block:].sum(-1, keepdim=True))
    block_mass = torch.cat(mass, -1).double()  # (B, ceil(V / block))
    cdf = block_mass.cumsum(-1)
    total = cdf[:, -1:]
    bad = ~(torch.isfinite(total) & (total > 0)).squeeze(-1)  # B values: a NaN or inf anywhere reaches the total
    if bad.any():
        rows = bad.nonzero().squeeze(-1).tolist()
        raise ValueError(
            f"sampling: probability rows {rows[:8]}{' ...' if len(rows) > 8 else ''} of {B} contain NaN or inf or "
            "sum to 0, so no token can be drawn (as torch.multinomial refuses them); the logits went non-finite "
            "(a diverged update, fp16 overflow) or a logits processor masked every token"
        )
    u = torch.minimum(torch.rand(B, 1, dtype=torch.float64, device=probs.device) * total,
                      torch.nextafter(total, torch.zeros_like(total)))
    b = torch.searchsorted(cdf, u, right=True)  # (B, 1)
    index = b * block + torch.arange(block, device=probs.device)  # (B, block); past V in the last block
    inner = torch.where(index < V, probs.gather(1, index.clamp(max=V - 1)), 0.0).double().cumsum(-1)
    # The offset inside the block, clamped against rounding between the two summation orders.
    offset = (u - (cdf.gather(-1, b) - block_mass.gather(-1, b))).clamp(min=0.0)
    offset = torch.minimum(offset, torch.nextafter(inner[:, -1:], torch.zeros_like(offset)))
    j = torch.searchsorted(inner, offset, right=True)
    return (b * block + j).squeeze(-1)


class TokenSampler(LogitsProcessor):
    """The last processor of a `do_sample=False` generate call that samples (see the module docstring).

    `warpers` are applied to the scores before sampling, as HF's sampling mode would apply them.
    """

    def __init__(self, temperature: float, top_k: int | None, top_p: float, min_p: float | None):
        self.warpers: list[LogitsProcessor] = []
        if temperature != 1.0:
            self.warpers.append(TemperatureLogitsWarper(temperature))
        if top_k:
            self.warpers.append(TopKLogitsWarper(top_k=top_k))
        if top_p < 1.0:
            self.warpers.append(TopPLogitsWarper(top_p=top_p))
        if min_p:
            self.warpers.append(MinPLogitsWarper(min_p=min_p))

    def draw(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """(B,) tokens drawn from the warped `scores` (B, V)."""
        for warp in self.warpers:
            scores = warp(input_ids, scores)
        return sample_categorical(torch.softmax(scores.float(), dim=-1))

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        tokens = self.draw(input_ids, scores)
        chosen = torch.full_like(scores, float("-inf"))
        return chosen.scatter_(1, tokens.unsqueeze(-1), 0.0)
