"""Sampling log-probs recorded while decoding: they match a forward pass in fp32 and save that forward."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rloo_engine import trainer as trainer_module
from rloo_engine.generation.base import SamplingParams
from rloo_engine.generation.hf import HFGenerationBackend
from rloo_engine.logprobs import batched_token_logps
from rloo_engine.trainer import RLOOTrainer
from tests.engine.helpers import read_metrics, tiny_config

# fp32: the KV-cached decoding logits and a full forward differ only in summation order.
FP32_TOLERANCE = 1e-5


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("shared_prefill", [True, False])
def test_decoding_log_probs_match_a_forward_pass_in_fp32(qwen2_model, temperature, shared_prefill):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(qwen2_model)
    tok = AutoTokenizer.from_pretrained(qwen2_model)
    backend = HFGenerationBackend(lambda: model, tok, SamplingParams(10, temperature=temperature, max_prompt_length=16),
                                  shared_prefill=shared_prefill, record_logps=True)
    rollout = backend.generate(["the cat sat on", "a dog", "red blue green tree big"], 4)
    ids = torch.cat([rollout.prompt_ids, rollout.completion_ids], 1)
    attention = torch.cat([rollout.prompt_mask, rollout.completion_mask], 1)
    forward = batched_token_logps(model, ids, attention, rollout.prompt_ids.size(1), temperature, 8)
    assert rollout.sampling_logps.shape == rollout.completion_mask.shape
    assert (rollout.sampling_logps - forward * rollout.completion_mask).abs().max() < FP32_TOLERANCE
    assert rollout.sampling_logps[rollout.completion_mask == 0].eq(0).all()


def test_with_beta_the_trainer_runs_only_the_reference_forward(tmp_path, qwen2_model, monkeypatch):
    calls = []
    real = trainer_module.batched_token_logps
    monkeypatch.setattr(trainer_module, "batched_token_logps",
                        lambda model, *a, **k: calls.append(model) or real(model, *a, **k))
    for source in ("generation", "forward"):
        calls.clear()
        cfg = tiny_config(tmp_path / source, qwen2_model, beta=0.1, max_steps=2, learning_rate=3e-2,
                          sampling_logprobs=source)
        trainer = RLOOTrainer(cfg)
        trainer.train()
        # per generation batch the reference only: pi_old is recorded while decoding, or (`forward`, a generation
        # batch of one micro-batch) the training forward's own (test_kl_from_training_forward.py)
        assert len(calls) == 2, source
    kl = {s: read_metrics(tmp_path / s / "out")[-1]["sequence_kl"] for s in ("generation", "forward")}
    assert abs(kl["forward"]) > 1e-3  # two updates at lr 3e-2 moved the policy: a KL worth comparing
    assert kl["generation"] == pytest.approx(kl["forward"], rel=1e-3)
    # two micro-batches a generation batch: the second trains after an optimizer step, so pi_old needs its pass
    calls.clear()
    cfg = tiny_config(tmp_path / "two", qwen2_model, beta=0.1, max_steps=2, sampling_logprobs="forward",
                      steps_per_generation=2, per_device_train_batch_size=4)
    RLOOTrainer(cfg).train()
    assert len(calls) == 2  # one generation batch: the policy, then the reference


def test_auto_takes_the_forward_pass_in_mixed_precision(tmp_path, qwen2_model):
    assert tiny_config(tmp_path, qwen2_model).logprobs_from_generation
    assert not tiny_config(tmp_path, qwen2_model, bf16=True).logprobs_from_generation
    assert not tiny_config(tmp_path, qwen2_model, repetition_penalty=1.1).logprobs_from_generation
