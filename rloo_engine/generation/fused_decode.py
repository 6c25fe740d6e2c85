"""The HF backend's decoding loop for float32 Qwen2-, Qwen3-, Llama- and Mistral-shaped models, in ~15 tensor ops a layer.

Why: at a small hidden size a decode step is mostly per-op overhead, not arithmetic (bench/README.md, "The decode
loop's per-step overhead"). transformers' decoder layer runs ~50 ops per token step (separate q/k/v and gate/up
matmuls, a six-op RMSNorm, rotate_half by slicing and `cat`, mask construction, cache bookkeeping), and `generate`
adds its own per-step work. `FusedDecoder` runs the same math on the same weights with q/k/v and gate/up packed into
one matmul each, `F.rms_norm`, the residual adds folded into `addmm`, and rotary embedding as two fused multiply-adds
over q and k together, writing keys and values straight into the sequence-major cache (kv_cache.py). `decode` is
the sampling loop `generate` would run for the backend's settings: same processors in the same order, same
stopping rule, same padding of finished rows, the same random draws. Qwen3's per-head q/k RMSNorm is two more ops a
layer; Mistral is Llama's layer (without a sliding window). Gemma (soft-capping, GELU, scaled embeddings, sliding
layers), Phi-3 (packed projections under other names) and mixture-of-experts MLPs are other layers: `generate`.

Only where that loop is exactly `generate`'s: no generation kwargs, no repetition penalty, no logits processor or
stopping rule from the model's generation_config (`unsupported_reason`). The trainer checks the decode step against
the model's own forward on a probe batch at start-up (`decode_step_difference`) and falls back to `generate` with a
message when they disagree.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from transformers import GenerationConfig

from rloo_engine.generation.kv_cache import SequenceMajorLayer, cache_keyword, sequence_major_cache
from rloo_engine.generation.sampling import PROCESSOR_KWARGS

_ARCHITECTURES = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "LlamaForCausalLM", "MistralForCausalLM")
# Rope types whose cos/sin at a position do not depend on the sequence length seen so far.
_ROPE_TYPES = ("default", "linear", "llama3")
# generation_config fields that add a processor or stopping rule `decode` would not apply: the processor kwargs
# the HF backend knows (the two that only `generate` calls take excluded), and a few `generate` applies itself.
_CONFIG_FIELDS = (*sorted(PROCESSOR_KWARGS - {"logits_processor", "stopping_criteria"}),
                  "watermarking_config", "guidance_scale", "renormalize_logits")


def unsupported_reason(model: Any, extra: dict[str, Any] | None, repetition_penalty: float) -> str | None:
    """Why `FusedDecoder` cannot stand in for `model.generate` here, or None when it can."""
    # FSDP2 makes a module an instance of `FSDP<its class>`, a subclass; the architecture is the class it came from.
    name = next((c.__name__ for c in type(model).__mro__ if c.__name__ in _ARCHITECTURES), type(model).__name__)
    if hasattr(model, "get_base_model"):
        return f"a PEFT model ({name}): the loop reads plain weights, not adapters"
    if name not in _ARCHITECTURES:
        return f"{name} is not one of {', '.join(_ARCHITECTURES)}"
    if any(p.dtype != torch.float32 for p in model.parameters()):
        return "its weights are not all float32"
    if torch.is_autocast_enabled(next(model.parameters()).device.type):
        return "autocast (bf16/fp16 mixed precision) is on"
    if hasattr(model, "_original_forward"):
        # accelerate's mixed precision wraps the prepared model's forward in autocast; autocast is then off here,
        # outside the forward, and on inside it: the decoding step (float32) and the forward (bf16) would differ
        return "mixed precision (accelerate runs the model's forward under autocast)"
    cfg = model.config
    if getattr(cfg, "hidden_act", None) != "silu":
        return f"hidden_act {getattr(cfg, 'hidden_act', None)!r} is not 'silu'"
    if any(kind != "full_attention" for kind in getattr(cfg, "layer_types", None) or ()):
        return "it has sliding-window layers"
    if getattr(cfg, "sliding_window", None) is not None and not getattr(cfg, "layer_types", None):
        return f"sliding_window {cfg.sliding_window} (every layer attends to a window)"  # Mistral v0.1
    rope = getattr(model.model.rotary_emb, "rope_type", None)
    if rope not in _ROPE_TYPES:
        return f"rope_type {rope!r} is not one of {', '.join(_ROPE_TYPES)}"
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        biases = [attn.q_proj.bias is None, attn.k_proj.bias is None, attn.v_proj.bias is None]
        if len(set(biases)) > 1 or attn.o_proj.bias is not None or any(
                m.bias is not None for m in (mlp.gate_proj, mlp.up_proj, mlp.down_proj)):
            return "a projection has a bias the packed layer does not carry"
    if model.lm_head.bias is not None:
        return "the LM head has a bias"
    if extra:
        return f"generation_kwargs {sorted(extra)}"
    if repetition_penalty != 1.0:
        return "repetition_penalty is not 1.0"
    defaults, gen = GenerationConfig(), model.generation_config
    changed = [f for f in _CONFIG_FIELDS if getattr(gen, f, None) != getattr(defaults, f, None)]
    if changed:
        return f"the model's generation_config sets {', '.join(changed)}"
    return None


class FusedDecoder:
    """`model`'s decoder layers packed for one-token steps; positions below `positions` are supported. Holds copies
    of the q/k/v and gate/up weights (build one per generation call: the weights change every optimizer step).

    `dtype` (e.g. bfloat16): every step runs in it, on copies of all the matmul weights in it (`generation_dtype`);
    the embedding rows a step looks up are cast, not the table. None: the model's own (float32) weights."""

    def __init__(self, model: Any, positions: int, dtype: torch.dtype | None = None):
        body, cfg = model.model, model.config
        cast = (lambda t: t) if dtype is None else (lambda t: t.to(dtype))
        self.dtype = dtype
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = body.layers[0].self_attn.head_dim
        self.intermediate = cfg.intermediate_size
        self.layers = []
        for layer in body.layers:
            attn, mlp = layer.self_attn, layer.mlp
            qkv = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]).t()
            bias = (None if attn.q_proj.bias is None else
                    torch.cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]))
            gate_up = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).t()
            qk_norms = (attn.q_norm, attn.k_norm) if hasattr(attn, "q_norm") else None  # Qwen3: per head, pre-rope
            if qk_norms is not None:
                qk_norms = tuple(_Norm.of(n, cast) for n in qk_norms)
            self.layers.append((_Norm.of(layer.input_layernorm, cast), cast(qkv), None if bias is None else cast(bias),
                                qk_norms, cast(attn.o_proj.weight.t()), attn.scaling,
                                _Norm.of(layer.post_attention_layernorm, cast), cast(gate_up),
                                cast(mlp.down_proj.weight.t())))
        self.embed, self.norm, self.head = body.embed_tokens.weight, _Norm.of(body.norm, cast), cast(model.lm_head.weight.t())
        cos, sin = body.rotary_emb(self.embed[:1, None], torch.arange(positions, device=self.embed.device)[None])
        half = self.head_dim // 2
        sign = torch.cat([-torch.ones(half), torch.ones(half)]).to(sin)
        # rotate_half(x) * sin == flip_halves(x) * (sin with its first half negated): one flip, no slicing or cat.
        self.cos, self.sin = cast(cos[0]), cast(sin[0] * sign)  # (positions, head_dim)

    def step(self, layers: list[SequenceMajorLayer], tokens: torch.Tensor, positions: torch.Tensor,
             attend: torch.Tensor | None) -> torch.Tensor:
        """tokens, positions: (B,); attend: (B, 1, 1, L + 1) bool over the cached rows and this one, or None when
        every row attends to all of them. Appends each layer's key and value; returns (B, V) float32 logits."""
        h = self.embed[tokens] if self.dtype is None else self.embed[tokens].to(self.dtype)  # (B, hidden)
        B, H, Hkv, D = h.shape[0], self.heads, self.kv_heads, self.head_dim
        cos, sin = self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)  # (B, 1, D)
        for cache, (norm1, qkv_w, qkv_b, qk_norms, o_w, scale, norm2, gate_up_w, down_w) in zip(layers, self.layers):
            x = _rms_norm(norm1, h)
            qkv = x @ qkv_w if qkv_b is None else torch.addmm(qkv_b, x, qkv_w)
            qk = qkv[:, : (H + Hkv) * D].view(B, H + Hkv, D)  # q and k heads, rotated together
            if qk_norms is not None:
                qk = torch.cat([_rms_norm(qk_norms[0], qk[:, :H]), _rms_norm(qk_norms[1], qk[:, H:])], 1)
            flipped = qk.view(B, H + Hkv, 2, D // 2).flip(2).view(B, H + Hkv, D)
            qk = torch.addcmul(qk * cos, flipped, sin)
            keys, values = cache.append_token(qk[:, H:], qkv[:, (H + Hkv) * D :].view(B, Hkv, D))
            out = F.scaled_dot_product_attention(qk[:, :H].unsqueeze(2), keys, values, attn_mask=attend, scale=scale,
                                                 enable_gqa=H != Hkv)
            h = torch.addmm(h, out.view(B, H * D), o_w)
            gate_up = _rms_norm(norm2, h) @ gate_up_w
            h = torch.addmm(h, F.silu(gate_up[:, : self.intermediate]) * gate_up[:, self.intermediate :], down_w)
        return (_rms_norm(self.norm, h) @ self.head).float()

    def decode(self, cache: Any, sequences: torch.Tensor, prefix_mask: torch.Tensor, max_new_tokens: int,
               processors: list[Callable], draw: Callable, eos_ids: tuple[int, ...], pad_id: int) -> torch.Tensor:
        """Continues `sequences` (B, P), whose first P - 1 tokens are in `cache` under `prefix_mask` (B, P - 1),
        as `generate(do_sample=False)` would with `processors` then `draw` (ids, scores) -> (B,) tokens: rows that
        drew an EOS are padded from then on, and the loop stops when every row has or after `max_new_tokens`.
        Returns (B, P + T) ids."""
        layers = cache.layers
        if self.dtype is not None:
            for layer in layers:
                layer.cast(self.dtype)  # the prefill's keys and values, for attention in the decoding dtype
        B, P = sequences.shape
        out = sequences.new_full((B, P + max_new_tokens), pad_id)
        out[:, :P] = sequences
        padded = not bool(prefix_mask.all())
        attend = torch.ones(B, P - 1 + max_new_tokens, dtype=torch.bool, device=sequences.device)
        attend[:, : P - 1] = prefix_mask.bool()
        positions = prefix_mask.sum(-1)  # the last prompt token's position (left padding)
        eos = torch.tensor(eos_ids, device=sequences.device)
        unfinished = torch.ones(B, dtype=torch.bool, device=sequences.device)
        tokens = sequences[:, -1]
        for t in range(max_new_tokens):
            scores = self.step(layers, tokens, positions + t, attend[:, None, None, : P + t] if padded else None)
            ids = out[:, : P + t]
            for process in processors:
                scores = process(ids, scores)
            tokens = torch.where(unfinished, draw(ids, scores), pad_id)
            out[:, P + t] = tokens
            unfinished &= ~torch.isin(tokens, eos)
            if not unfinished.any():
                return out[:, : P + t + 1]
        return out


class _Norm(tuple):
    """An RMSNorm's (weight, epsilon), the weight in the decoding dtype."""

    @classmethod
    def of(cls, norm: torch.nn.Module, cast: Callable) -> _Norm:
        return cls((cast(norm.weight), norm.variance_epsilon))


def _rms_norm(norm: _Norm, x: torch.Tensor) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), norm[0], norm[1])


@torch.no_grad()
def decode_step_difference(model: Any, vocab: int) -> float:
    """Largest |log-prob difference| between `FusedDecoder.step` and the model's own forward at the last position
    of a left-padded random probe batch (2 rows of 7 tokens); ~1e-6 in float32 when the two run the same math."""
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, min(vocab, model.config.vocab_size), (2, 7), generator=generator).to(device)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    was_training = model.training
    model.eval()
    try:
        full = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits[:, -1].float()
        cache = sequence_major_cache(model.config, ids.size(1))
        model(input_ids=ids[:, :-1], attention_mask=mask[:, :-1], position_ids=positions[:, :-1], use_cache=True,
              logits_to_keep=1, **{cache_keyword(model): cache})
        decoder = FusedDecoder(model, ids.size(1))
        fused = decoder.step(cache.layers, ids[:, -1], positions[:, -1], mask.bool()[:, None, None, :])
    finally:
        model.train(was_training)
    return (torch.log_softmax(full, -1) - torch.log_softmax(fused.float(), -1)).abs().max().item()
