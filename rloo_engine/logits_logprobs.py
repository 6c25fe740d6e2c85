"""Per-token log-probs from the LM head's full logits, whose gradient is written over the logits themselves.

Why: `algorithm.token_log_probs` is the readable statement of the math. Run under autograd it keeps a float32
scaled copy of every row's (T, V) logits for the backward, then builds the logits' gradient as further (B, T, V)
tensors (the logsumexp's and the gather's, summed, then stacked). At vocabulary 152k and 16 x 64 completion tokens
each of those is 594 MiB: the update's largest tensors. Here the forward keeps only the logits (already alive) and
one log-normaliser per position; the backward turns each chunk of logits into its gradient in place,
d logp(token) / d logit_v = ([v == token] - softmax_v) / temperature, and hands the same buffer to the LM head's
backward. Same values and gradients (the same float32 operations); measured on a (16, 64) x 152k head over
hidden 512: peak memory of the head's forward+backward 1799 -> 973 MiB, its time 10.0 -> 7.3 s (bench/README.md,
round 3).

The logits are consumed: after the backward they hold their gradient. Callers pass logits nobody else reads
(`logprobs.completion_token_logps` passes the model's fresh head output). A second backward through the same
graph is refused by autograd (the saved logits were modified in place), never silently wrong.
"""

from __future__ import annotations

import torch

# Positions per chunk: about 4M logits (16 MiB in float32) of temporaries at a time.
_CHUNK_LOGITS = 1 << 22


def _chunks(piece: torch.Tensor):
    """(b, positions slice) of `piece` (B, T, V), each (c, V) chunk inside one row."""
    step = max(1, _CHUNK_LOGITS // piece.size(-1))
    for b in range(piece.size(0)):
        for start in range(0, piece.size(1), step):
            yield b, slice(start, start + step)


def _scaled(x: torch.Tensor, temperature: float) -> torch.Tensor:
    """(c, V) float32 logits / temperature; the chunk itself when nothing changes it."""
    x = x.float()
    return x if temperature == 1.0 else x / temperature


class _LogitsLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tokens, temperature, with_entropy, *pieces):
        B, T = tokens.shape
        logps = torch.empty(B, T, dtype=torch.float32, device=tokens.device)
        log_norm = torch.empty_like(logps)
        entropy = torch.empty_like(logps) if with_entropy else None
        offset = 0
        for piece in pieces:
            for b, rows in _chunks(piece):
                x = _scaled(piece[b, rows], temperature)  # (c, V)
                at = slice(offset + rows.start, offset + rows.start + x.size(0))
                if entropy is None:
                    log_norm[b, at] = torch.logsumexp(x, dim=-1)
                else:  # one exp pass for both: H = logZ - sum_v p_v x_v, a metric
                    peak = x.amax(-1, keepdim=True)
                    e = torch.exp(x - peak)
                    mass = e.sum(-1)
                    log_norm[b, at] = torch.log(mass) + peak.squeeze(-1)
                    entropy[b, at] = log_norm[b, at] - torch.linalg.vecdot(e, x) / mass
                logps[b, at] = x.gather(1, tokens[b, at, None]).squeeze(1) - log_norm[b, at]
            offset += piece.size(1)
        ctx.save_for_backward(tokens, log_norm, *pieces)
        ctx.temperature = temperature
        if entropy is not None:
            ctx.mark_non_differentiable(entropy)
        return logps, entropy

    @staticmethod
    def backward(ctx, grad_logps, grad_entropy):
        tokens, log_norm, *pieces = ctx.saved_tensors
        t = ctx.temperature
        g = grad_logps.float() / t
        offset = 0
        for piece in pieces:
            for b, rows in _chunks(piece):
                chunk = piece[b, rows]
                at = slice(offset + rows.start, offset + rows.start + chunk.size(0))
                # In place where the chunk is float32 already: the logits become their gradient.
                x = chunk if chunk.dtype == torch.float32 else chunk.float()
                if t != 1.0:
                    x.div_(t)
                x.sub_(log_norm[b, at, None]).exp_().mul_(-g[b, at, None])
                x[torch.arange(x.size(0), device=x.device), tokens[b, at]] += g[b, at]
                if x is not chunk:
                    chunk.copy_(x)
            offset += piece.size(1)
        return (None, None, None, *pieces)


def logits_token_log_probs(pieces: list[torch.Tensor], tokens: torch.Tensor, temperature: float = 1.0,
                           with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`algorithm.token_log_probs` over logits given as `pieces` along the positions, (B, T_k, V) each with
    sum T_k = T (no `torch.cat` of the logits); tokens: (B, T) int64. Returns (logps (B, T) float32, entropy (B, T)
    float32 without gradient, or None). The backward overwrites the pieces with their gradient (module docstring)."""
    if sum(p.size(1) for p in pieces) != tokens.size(1):
        raise ValueError(f"logits pieces cover {[p.size(1) for p in pieces]} positions; tokens have {tokens.size(1)}")
    return _LogitsLogProbs.apply(tokens, temperature, with_entropy, *pieces)
