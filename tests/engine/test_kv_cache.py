"""The sequence-major decoding cache holds what transformers' DynamicCache holds, appends in place, and the HF
backend samples the same tokens and log-probs with it."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache
from transformers.cache_utils import DynamicLayer

import rloo_engine.generation.hf as generation
from rloo_engine.generation.base import SamplingParams
from rloo_engine.generation.hf import HFGenerationBackend
from rloo_engine.generation.kv_cache import SequenceMajorLayer, sequence_major_cache


def _kv(batch: int, length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 2, length, 8, generator=g), torch.randn(batch, 2, length, 8, generator=g)


def test_a_layer_holds_what_dynamic_layers_hold_through_appends_growth_and_batch_operations():
    ours, theirs = SequenceMajorLayer(capacity=9), DynamicLayer()

    def step(op, *args):
        a, b = getattr(ours, op)(*args), getattr(theirs, op)(*args)
        assert torch.equal(ours.keys, theirs.keys) and torch.equal(ours.values, theirs.values), op
        assert ours.get_seq_length() == theirs.get_seq_length()
        return a, b

    step("update", *_kv(2, 5, 0))  # a prefill
    step("batch_repeat_interleave", 3)  # (2, ...) -> (6, ...), as the shared prefill does
    for t in range(12):  # past the reserved 9 rows: the buffer grows and keeps what it held
        (keys, values), (their_keys, _) = step("update", *_kv(6, 1, 1 + t))
        assert torch.equal(keys, their_keys)
    step("batch_select_indices", torch.tensor([5, 0, 2]))
    step("crop", -4)
    step("update", *_kv(3, 2, 99))
    assert ours.get_seq_length() == 5 + 12 - 4 + 2


def test_appending_wider_states_promotes_the_stored_ones_as_concatenation_does():
    """A bf16 LoRA prefill can store float32 keys and bf16 values, then decode float32 values (seen with
    transformers 5.25): DynamicLayer's cat promotes the values, and attention needs them float32."""
    ours, theirs = SequenceMajorLayer(capacity=8), DynamicLayer()
    keys, values = _kv(2, 4, 0)
    for layer in (ours, theirs):
        layer.update(keys, values.bfloat16())
    new_keys, new_values = _kv(2, 1, 1)
    ours.update(new_keys, new_values)
    theirs.update(new_keys, new_values)
    assert ours.values.dtype == theirs.values.dtype == torch.float32
    assert torch.equal(ours.values, theirs.values) and torch.equal(ours.keys, theirs.keys)
    assert ours._value_rows.shape[0] == 8  # promoted in place of the old buffer, not grown


def test_an_append_within_capacity_writes_in_place_and_copies_no_earlier_token():
    layer = SequenceMajorLayer(capacity=16)
    layer.update(*_kv(4, 6, 0))
    first_keys, _ = layer.update(*_kv(4, 1, 1))
    storage = first_keys.untyped_storage().data_ptr()
    for t in range(9):
        keys, values = layer.update(*_kv(4, 1, 2 + t))
        assert keys.untyped_storage().data_ptr() == storage  # the same buffer: nothing was concatenated
        assert keys.shape == (4, 2, 8 + t, 8) and values.shape == keys.shape
    assert torch.equal(first_keys[:, :, :7], keys[:, :, :7])  # what attention saw earlier is untouched


def test_only_full_attention_layers_are_replaced(qwen2_model):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(qwen2_model)
    config.layer_types = ["sliding_attention", "full_attention"] * (config.num_hidden_layers // 2)
    config.use_sliding_window, config.sliding_window = True, 4
    kinds = [type(layer) for layer in sequence_major_cache(config, 32).layers]
    assert kinds[1::2] == [SequenceMajorLayer] * (config.num_hidden_layers // 2)
    assert SequenceMajorLayer not in kinds[::2]


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_the_backend_samples_the_same_tokens_and_log_probs_as_with_dynamic_cache(family, qwen2_model, llama_model,
                                                                                monkeypatch):
    path = {"qwen2": qwen2_model, "llama": llama_model}[family]
    model = AutoModelForCausalLM.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    prompts = ["the cat sat on the mat and", "a dog", "once upon a time there was a little"]  # left-padded
    new_tokens = 12
    backend = HFGenerationBackend(lambda: model, tok, SamplingParams(new_tokens, temperature=1.0),
                                  record_logps=True)

    made = []

    def recording_factory(config, capacity):
        made.append(sequence_major_cache(config, capacity))
        return made[-1]

    def sample(factory):
        monkeypatch.setattr(generation, "sequence_major_cache", factory)
        torch.manual_seed(0)
        return backend.generate(prompts, 4)

    ours = sample(recording_factory)
    theirs = sample(lambda config, capacity: DynamicCache(config=config))
    assert torch.equal(ours.completion_ids, theirs.completion_ids)
    assert torch.equal(ours.completion_mask, theirs.completion_mask)
    assert torch.allclose(ours.sampling_logps, theirs.sampling_logps, atol=1e-6)
    # generate decoded on the cache it was given: every prompt token and every new token but the last went in
    (cache,) = made
    assert {type(layer) for layer in cache.layers} == {SequenceMajorLayer}
    assert cache.layers[0].length == ours.prompt_ids.size(1) + ours.completion_ids.size(1) - 1
