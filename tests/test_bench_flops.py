"""bench/flops.py counts what the models multiply: its parameter counts against a real Qwen2, and its per-phase work
against the two trainers' passes."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from bench import flops

SHAPE = flops.Shape(hidden=64, layers=3, intermediate=256, heads=4, kv_heads=2, head_dim=16, vocab=500)


def test_the_shape_counts_the_models_matmul_weights():
    model = AutoModelForCausalLM.from_config(Qwen2Config(
        hidden_size=64, num_hidden_layers=3, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=500, tie_word_embeddings=False))
    linear = sum(m.weight.numel() for name, m in model.named_modules()
                 if isinstance(m, torch.nn.Linear) and name.startswith("model.layers"))
    assert SHAPE.body == linear
    assert SHAPE.head == model.lm_head.weight.numel()


def test_the_engine_saves_the_shared_prompts_and_trls_extra_forward():
    tokens = flops.Tokens(rows=16, group=4, prompt=8, completion=16 * 64)
    engine, trl = flops.engine_phases(SHAPE, tokens), flops.trl_phases(SHAPE, tokens, beta=0.05)
    assert trl["reference"] == pytest.approx(2 * trl["generation"])  # TRL: old_per_token_logps + the reference
    assert engine["reference"] == pytest.approx(engine["generation"])  # the engine: the reference only
    assert engine["reward"] < engine["generation"]  # no LM head
    one_prompt_each = flops.Tokens(rows=16, group=1, prompt=8, completion=16 * 64)  # nothing to share
    assert flops.engine_phases(SHAPE, one_prompt_each)["policy_update"] == pytest.approx(
        flops.trl_phases(SHAPE, one_prompt_each, beta=0.05)["policy_update"])
    assert engine["policy_update"] < trl["policy_update"]  # G = 4: each prompt forwarded once


def test_the_decode_ceiling_and_peak_are_rates():
    assert flops.matmul_peak(size=128, seconds=0.05) > 0
    assert flops.decode_matmul_ceiling(SHAPE, batch=4, steps=2) > 0
