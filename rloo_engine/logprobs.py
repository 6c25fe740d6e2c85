"""Per-token log-probs of completions: the policy/reference forwards (`completion_token_logps`, batched and no-grad
variants, the truncated-sampling pass for vLLM) and the probes that check a fast path against the plain one.

The chunked head: per-token log-probs from the final hidden states, a chunk of positions at a time, so the
(B, T, V) logits never exist.

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

import contextlib
from typing import Any

import torch

from rloo_engine import algorithm as A
from rloo_engine.distributed import is_shard
from rloo_engine.logits_logprobs import logits_token_log_probs
from rloo_engine.prompt_sharing import prompt_groups, shared_prompt_outputs
from rloo_engine.vision import VisionRows

# Positions per chunk: about 8M logits (32 MiB in float32) at a time.
_CHUNK_LOGITS = 1 << 23
# Config fields of architectures known to transform the logits after the LM head. Not the only guard: the
# trainer also compares the chunked path with the model's own log-probs on a probe batch at start-up
# (`chunked_head_difference`, below), which catches transforms under names nobody listed.
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale",
                     "lm_head_multiplier", "output_multiplier")


def chunkable_head(model: torch.nn.Module) -> torch.nn.Linear | None:
    """The LM head of `model` (possibly DDP/DeepSpeed-wrapped) when the chunked path reproduces it, else None."""
    inner = model.module if isinstance(getattr(model, "module", None), torch.nn.Module) else model
    get_head = getattr(inner, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if type(head) is not torch.nn.Linear or hasattr(head.weight, "ds_id") or is_shard(head.weight):
        return None  # ds_id: a ZeRO-3 partitioned weight; a DTensor: FSDP2's shard, whole only inside the model's forward
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


def completion_token_logps(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    prompt_length: int,
    temperature: float,
    with_entropy: bool = False,
    chunked: bool = False,
    share_prompts: bool = False,
    vision: VisionRows | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probs of the completion part. input_ids, attention_mask: (B, P + T) -> (B, T) each.

    Only the T completion positions reach the LM head (`logits_to_keep`), so the prompt never costs a
    vocabulary-sized projection. With `chunked` (and a head it can reproduce, see `logprobs.py`) the
    head runs in chunks of positions and the (B, T, V) logits never exist. With `share_prompts`, adjacent rows
    with the same prompt share one forward of it (`prompt_sharing.py`). `vision`: the rows' pixel inputs, for a
    vision-language model (every row's prompt then runs whole: the shared path splits a text decoder's cache).
    """
    tokens = input_ids[:, prompt_length:]
    head = chunkable_head(model) if chunked else None
    pieces = _completion_outputs(model, _run_to_head(head), input_ids, attention_mask, prompt_length, share_prompts,
                                 vision)
    if head is None:
        return logits_token_log_probs(pieces, tokens, temperature, with_entropy)
    return chunked_token_log_probs(torch.cat(pieces, 1), head, tokens, temperature, with_entropy)


def _completion_outputs(model, run, input_ids, attention_mask, prompt_length: int, share_prompts: bool,
                        vision: VisionRows | None = None) -> list[torch.Tensor]:
    """`run`'s output (logits, or the head's input) at the T positions that predict the completion tokens, as
    pieces along the positions (B, T_k, .) that are the forward's own outputs (no slice or `cat` of the logits).
    The last completion token predicts nothing scored, so no forward runs it."""
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    groups = (prompt_groups(input_ids[:, :prompt_length], attention_mask[:, :prompt_length])
              if share_prompts and prompt_length > 1 and vision is None else None)
    if groups is None:
        completion_len = input_ids.size(1) - prompt_length
        length = input_ids.size(1) - 1  # position t predicts token t + 1
        # on the ids' device: vLLM's rollouts carry the pixels on the CPU
        extra = {} if vision is None else vision.to(input_ids.device).model_kwargs(length)
        if vision is None or not vision.own_positions:  # Qwen2-VL numbers positions from the images itself
            extra["position_ids"] = position_ids[:, :length]
        return [run(model, input_ids=input_ids[:, :length], attention_mask=attention_mask[:, :length],
                    logits_to_keep=completion_len, use_cache=False, **extra)]
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
def frozen(model: torch.nn.Module, like: torch.nn.Module | None = None):
    """`model`'s parameters with requires_grad off (or, given `like`, set as `like`'s parameters of the same names
    are), restored after. Under no_grad that changes no value, but `torch.matmul` picks its kernel path (folding a
    (B, 1, H) input into one mm or not) by its operands' requires_grad, so a trainable policy and its frozen
    reference copy could round the same input differently (a KL of 1e-7 between identical models on some CPUs).
    `like=policy` gives a reference pass the kernels of the policy's training forward."""
    wanted = {} if like is None else {name: p.requires_grad for name, p in like.named_parameters()}
    saved = {p: p.requires_grad for p in model.parameters()}
    for name, p in model.named_parameters():
        p.requires_grad_(wanted.get(name, False))
    try:
        yield model
    finally:
        for p, flag in saved.items():
            p.requires_grad_(flag)


@torch.no_grad()
def batched_token_logps(model, input_ids, attention_mask, prompt_length, temperature, batch_size,
                        chunked: bool = False, share_prompts: bool = False,
                        kernels_of: torch.nn.Module | None = None, vision: VisionRows | None = None) -> torch.Tensor:
    """No-grad `completion_token_logps` over a whole generation batch, `batch_size` rows at a time, with the
    kernels a frozen model gets, or with `kernels_of` those of that model's training forward (`frozen`)."""
    with frozen(model, like=kernels_of):
        parts = [
            completion_token_logps(model, input_ids[i : i + batch_size], attention_mask[i : i + batch_size],
                                   prompt_length, temperature, chunked=chunked, share_prompts=share_prompts,
                                   vision=_rows(vision, i, batch_size))[0]
            for i in range(0, input_ids.size(0), batch_size)
        ]
    return torch.cat(parts)


@torch.no_grad()
def batched_truncated_token_logps(model, input_ids, attention_mask, prompt_length, temperature, batch_size,
                                  truncation: dict, share_prompts: bool = False,
                                  vision: VisionRows | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`batched_token_logps` (without the chunked head: the truncation needs each position's whole distribution)
    and, from the same forward, each completion position's `A.sampling_kept_log_mass` under `truncation`
    ({top_k, top_p, min_p}, vLLM's order). Returns ((N, T), (N, T)) float32."""
    tokens = input_ids[:, prompt_length:]
    logps, kept = [], []
    with frozen(model):
        for i in range(0, input_ids.size(0), batch_size):
            rows = slice(i, i + batch_size)
            logits = torch.cat(_completion_outputs(model, _run_to_head(None), input_ids[rows], attention_mask[rows],
                                                   prompt_length, share_prompts, _rows(vision, i, batch_size)), 1)
            logps.append(A.token_log_probs(logits, tokens[rows], temperature)[0])
            kept.append(torch.stack([A.sampling_kept_log_mass(row.float() / temperature, **truncation)
                                     for row in logits]))  # a (T, V) slice at a time, as token_log_probs
    return torch.cat(logps), torch.cat(kept)


def _rows(vision: VisionRows | None, start: int, count: int) -> VisionRows | None:
    return None if vision is None else vision.rows(slice(start, start + count))


def probed_fast_paths(policy, vocab_size: int, autocast, half_precision: bool, chunked: bool, share: bool,
                      say) -> tuple[bool, bool]:
    """(chunked_logprobs, share_prompt_forward) as the run may use them: each asked-for path that gives the
    model's own log-probs on a probe batch (`fast_path.py`), else off with one line saying why."""
    from rloo_engine.fast_path import fast_path_holds, tolerance_for

    tolerance = tolerance_for(half_precision)

    def chunked_difference() -> float | str:
        difference = chunked_head_difference(policy, autocast)
        return ("its LM head is not a plain Linear the chunked path can run (LoRA on lm_head, ZeRO-3, FSDP2, "
                "a listed logit transform)") if difference is None else difference

    chunked = chunked and fast_path_holds("chunked_logprobs", chunked_difference, tolerance,
                                          "using the full logits", say)
    share = share and fast_path_holds("share_prompt_forward",
                                      lambda: shared_prompt_difference(policy, vocab_size, autocast),
                                      tolerance, "running every row's prompt", say)
    return chunked, share
