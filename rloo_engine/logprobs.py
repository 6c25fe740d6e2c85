"""Per-token log-probs from the final hidden states, a chunk of positions at a time: the (B, T, V) logits never exist.

Why: the full logits (B, T, V) in float32, their temperature-scaled copy and both gradients are
the update's largest tensors at real vocabularies. Here the forward keeps only the hidden states and
one log-normaliser per position; the backward recomputes each chunk's logits (one extra LM-head
matmul) and turns them into the hidden-state and weight gradients at once. `RLOOConfig.chunked_logprobs`
(off by default) has the measured trade: less peak memory, a slower update on CPU.

The model still runs its own forward (through DDP, DeepSpeed ZeRO-1/2 or PEFT wrappers): a forward
pre-hook on the LM head keeps the head's input and hands the head an empty slice, so the model's
own logits are (B, 0, V). Heads this cannot reproduce fall back to the full logits: a head that is
not a plain `nn.Linear` (e.g. LoRA on `lm_head`), weights partitioned by ZeRO-3, or a config that
rescales logits after the head (soft-capping, logit scales).
"""

from __future__ import annotations

from typing import Any

import torch

# Positions per chunk: about 8M logits (32 MiB in float32) at a time.
_CHUNK_LOGITS = 1 << 23
# Config fields of architectures known to transform the logits after the LM head. Not the only guard: the
# trainer also compares the chunked path with the model's own log-probs on a probe batch at start-up
# (`rollout.chunked_head_difference`), which catches transforms under names nobody listed.
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale",
                     "lm_head_multiplier", "output_multiplier")


def chunkable_head(model: torch.nn.Module) -> torch.nn.Linear | None:
    """The LM head of `model` (possibly DDP/DeepSpeed-wrapped) when the chunked path reproduces it, else None."""
    inner = model.module if isinstance(getattr(model, "module", None), torch.nn.Module) else model
    get_head = getattr(inner, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if type(head) is not torch.nn.Linear or hasattr(head.weight, "ds_id"):  # ds_id: a ZeRO-3 partitioned weight
        return None
    config = getattr(inner, "config", None)
    # Composite configs (e.g. Gemma3n) keep the text model's fields in get_text_config().
    text_config = config.get_text_config() if callable(getattr(config, "get_text_config", None)) else None
    for cfg in (config, text_config):
        if any(getattr(cfg, name, None) not in (None, 1.0) for name in _LOGIT_TRANSFORMS):
            return None
    return head


class HeadInput:
    """Forward pre-hook context: records the LM head's input (B, T, H) and gives the head an empty slice."""

    def __init__(self, head: torch.nn.Linear):
        self.head = head
        self.hidden: torch.Tensor | None = None
        self._handle: Any = None

    def _hook(self, module: torch.nn.Module, args: tuple) -> tuple:
        self.hidden = args[0]
        return (args[0][:, :0],)

    def __enter__(self) -> HeadInput:
        self._handle = self.head.register_forward_pre_hook(self._hook)
        return self

    def __exit__(self, *exc: object) -> None:
        self._handle.remove()


def _compute_dtype(tensor: torch.Tensor) -> torch.dtype:
    """The matmul dtype the head's own forward would use here: the autocast dtype when autocast is on."""
    device = tensor.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return tensor.dtype


def _scaled_logits(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype,
                   temperature: float) -> torch.Tensor:
    """(n, H) -> (n, V) float32 logits / temperature, with the matmul in `dtype` as the head would run it."""
    with torch.autocast(h.device.type, enabled=False):
        logits = h.to(dtype) @ weight.to(dtype).T
        if bias is not None:
            logits = logits + bias.to(dtype)
    return logits.float() / temperature


class _ChunkedLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, tokens, temperature, chunk, with_entropy):
        B, T, H = hidden.shape
        h, flat_tokens = hidden.reshape(-1, H), tokens.reshape(-1)
        dtype = _compute_dtype(hidden)
        logps = torch.empty(h.size(0), dtype=torch.float32, device=h.device)
        log_norm = torch.empty_like(logps)
        entropy = torch.empty_like(logps) if with_entropy else None
        for start in range(0, h.size(0), chunk):
            end = start + chunk
            logits = _scaled_logits(h[start:end], weight, bias, dtype, temperature)  # (c, V)
            log_norm[start:end] = torch.logsumexp(logits, dim=-1)
            logps[start:end] = logits.gather(1, flat_tokens[start:end, None]).squeeze(1) - log_norm[start:end]
            if entropy is not None:  # a metric: H = logZ - sum p * logit
                probs = torch.exp(logits - log_norm[start:end, None])
                entropy[start:end] = log_norm[start:end] - (probs * logits).sum(-1)
        ctx.save_for_backward(hidden, weight, bias, tokens, log_norm)
        ctx.temperature, ctx.chunk, ctx.dtype = temperature, chunk, dtype
        if entropy is None:
            return logps.view(B, T), None
        # Marked as returned: marking the flat tensor leaves its (B, T) view requiring grad, and a loss through
        # it would then get a silent zero gradient instead of an error.
        entropy = entropy.view(B, T)
        ctx.mark_non_differentiable(entropy)
        return logps.view(B, T), entropy

    @staticmethod
    def backward(ctx, grad_logps, grad_entropy):
        hidden, weight, bias, tokens, log_norm = ctx.saved_tensors
        B, T, H = hidden.shape
        h, flat_tokens, g = hidden.reshape(-1, H), tokens.reshape(-1), grad_logps.reshape(-1).float()
        grad_h = torch.empty(h.shape, dtype=hidden.dtype, device=h.device)
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        grad_b = torch.zeros(weight.size(0), dtype=torch.float32, device=weight.device) if bias is not None else None
        rows = torch.arange(min(ctx.chunk, h.size(0)), device=h.device)
        # Cast once, not once per chunk: under autocast a (V, H) copy per chunk cost time and a transient.
        w = weight.to(ctx.dtype)
        with torch.autocast(h.device.type, enabled=False):
            for start in range(0, h.size(0), ctx.chunk):
                end = start + ctx.chunk
                n = min(end, h.size(0)) - start
                logits = _scaled_logits(h[start:end], w, bias, ctx.dtype, ctx.temperature)
                # d logp(token) / d logit_v = [v == token] - p_v; the temperature divides once more.
                d_logits = torch.exp(logits - log_norm[start:end, None]).mul_(-g[start:end, None])
                d_logits[rows[:n], flat_tokens[start:end]] += g[start:end]
                d_logits = d_logits.div_(ctx.temperature).to(ctx.dtype)
                grad_h[start:end] = (d_logits @ w).to(hidden.dtype)
                h_chunk = h[start:end].to(ctx.dtype)
                if ctx.dtype == torch.float32:  # in place: no (V, H) temporary beside the accumulator
                    grad_w.addmm_(d_logits.T, h_chunk)
                else:  # a half-precision (V, H) product, added into the float32 accumulator without a copy
                    grad_w.add_(d_logits.T @ h_chunk)
                if grad_b is not None:
                    grad_b += d_logits.float().sum(0)
        grad_b = grad_b.to(bias.dtype) if grad_b is not None else None
        return grad_h.view(B, T, H), grad_w.to(weight.dtype), grad_b, None, None, None, None


def chunked_token_log_probs(
    hidden: torch.Tensor, head: torch.nn.Linear, tokens: torch.Tensor, temperature: float = 1.0,
    with_entropy: bool = False, chunk: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(head(hidden) / temperature) at `tokens`, without the full logits.

    hidden: (B, T, H), position t predicts tokens[:, t]; tokens: (B, T) int64.
    Returns (logps: (B, T) float32, entropy: (B, T) float32 or None; entropy carries no gradient).
    """
    chunk = chunk or max(1, _CHUNK_LOGITS // head.out_features)
    return _ChunkedLogProbs.apply(hidden, head.weight, head.bias, tokens, temperature, chunk, with_entropy)
