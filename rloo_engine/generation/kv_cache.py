"""A decoding KV cache whose append copies nothing: each full-attention layer stores its keys and values
sequence-major.

transformers' `DynamicLayer` keeps (B, H, L, D) tensors and appends a decode step's token with `torch.cat`, which
copies every layer's whole cache at every step. `SequenceMajorLayer` keeps (capacity, B, H, D) buffers: a new
token is written in place at row L, and attention gets rows [:L] as a (B, H, L, D) view (a permute, no copy).
Same keys and values, so the same attention output and the same sampled tokens; on CPU a 64-token generation of
16 rows took 6-10% less time (bench/README.md, "The decode loop's per-step overhead").

For no-grad decoding only: a view handed to attention shares its buffer with later in-place writes, which autograd
would refuse. The training and log-prob passes keep transformers' `DynamicCache`.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


class SequenceMajorLayer(DynamicLayer):
    """A `DynamicLayer` whose append writes into a preallocated (capacity, B, H, D) buffer; `keys` / `values`
    are (B, H, L, D) views of its filled rows. The buffer doubles when a write would overflow it."""

    _layer_type = None  # never registered as transformers' default layer of an attention type

    def __init__(self, capacity: int = 0, **kwargs):
        super().__init__(**kwargs)
        self.capacity = capacity  # rows to reserve at the first write (e.g. prompt + max new tokens)
        self._key_rows: torch.Tensor | None = None  # (capacity, B, H, D)
        self._value_rows: torch.Tensor | None = None
        self.length = 0

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = key_states.shape[-2]
        if (self._key_rows is None or self.length + n > self._key_rows.shape[0]
                or self._promoted(key_states, value_states) != (self._key_rows.dtype, self._value_rows.dtype)):
            self._reserve(self.length + n, key_states, value_states)
        self._key_rows[self.length : self.length + n] = key_states.permute(2, 0, 1, 3)
        self._value_rows[self.length : self.length + n] = value_states.permute(2, 0, 1, 3)
        self.length += n
        self._expose()
        return self.keys, self.values

    def append_token(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`update` for one decoded token's (B, H, D) keys and values of the stored dtypes, without its checks
        (fused_decode.py's step): writes row L and returns the (B, H, L + 1, D) views."""
        if self._key_rows is None or self.length >= self._key_rows.shape[0]:
            self._reserve(self.length + 1, key.unsqueeze(2), value.unsqueeze(2))
        self._key_rows[self.length] = key
        self._value_rows[self.length] = value
        self.length += 1
        self._expose()
        return self.keys, self.values

    def _promoted(self, key_states: torch.Tensor, value_states: torch.Tensor) -> tuple[torch.dtype, torch.dtype]:
        """The dtypes `torch.cat` would give the stored and the new states, as DynamicLayer's append does (a
        mixed-precision prefill can store bf16 values and then append float32 ones)."""
        if self._key_rows is None:
            return key_states.dtype, value_states.dtype
        return (torch.promote_types(self._key_rows.dtype, key_states.dtype),
                torch.promote_types(self._value_rows.dtype, value_states.dtype))

    def _reserve(self, rows: int, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """New buffers of at least `rows` rows (the reserved capacity; double the old on overflow, the old size on
        a dtype change alone) in the promoted dtypes, the filled rows kept."""
        old = 0 if self._key_rows is None else self._key_rows.shape[0]
        size = max(rows, self.capacity, 2 * old if rows > old else old)
        B, H, _, D = key_states.shape
        key_dtype, value_dtype = self._promoted(key_states, value_states)
        keys = key_states.new_empty(size, B, H, D, dtype=key_dtype)
        values = value_states.new_empty(size, B, H, value_states.shape[-1], dtype=value_dtype)
        if self.length:
            keys[: self.length] = self._key_rows[: self.length]
            values[: self.length] = self._value_rows[: self.length]
        self._key_rows, self._value_rows = keys, values

    def cast(self, dtype: torch.dtype) -> None:
        """Stores the filled rows (and later appends) in `dtype`: a float32 prefill decoded in bfloat16."""
        if self._key_rows is not None and self._key_rows.dtype != dtype:
            self._key_rows, self._value_rows = self._key_rows.to(dtype), self._value_rows.to(dtype)
            self._expose()

    def _expose(self) -> None:
        self.keys = self._key_rows[: self.length].permute(1, 2, 0, 3)
        self.values = self._value_rows[: self.length].permute(1, 2, 0, 3)

    def _adopt(self) -> None:
        """Takes `keys` / `values` as DynamicLayer's batch and crop operations left them into fresh buffers."""
        if not self.is_initialized or self.keys is None or self.keys.numel() == 0:
            return
        keys, values = self.keys, self.values
        self._key_rows = self._value_rows = None
        self.length = 0
        self.update(keys, values)

    # DynamicLayer's whole-cache operations rebind keys / values to new (B, H, L, D) tensors; the buffers follow.
    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        self._adopt()

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        self._adopt()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        self._adopt()

    def crop(self, tokens_to_remove: int) -> None:
        super().crop(tokens_to_remove)
        self._adopt()

    def reset(self) -> None:
        self._key_rows = self._value_rows = None
        self.length = 0
        super().reset()


def sequence_major_cache(config, capacity: int) -> DynamicCache:
    """A `DynamicCache` for `config` whose full-attention layers are `SequenceMajorLayer`s reserving `capacity`
    rows; sliding-window and other layer kinds stay transformers' own."""
    cache = DynamicCache(config=config)
    cache.layers = [SequenceMajorLayer(capacity) if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


def cache_keyword(model: Any) -> str:
    """The name the model's forward (and `generate`) gives the KV cache: `cache` from transformers 5.24,
    `past_key_values` before. Read from the base model: a PEFT wrapper's forward takes only **kwargs."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"
