"""The fused decoding loop samples what HF `generate` samples (tokens, stopping, recorded log-probs), runs only where
it is `generate`'s loop, and falls back with a message where it is not."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rloo_engine.generation.base import SamplingParams
from rloo_engine.generation.fused_decode import decode_step_difference, unsupported_reason
from rloo_engine.generation.hf import HFGenerationBackend
from rloo_engine.testing.tiny_models import lm_config

PROMPTS = ["the cat sat on the mat and", "a dog", "once upon a time there was a little"]  # left-padded


def _model(path, **config_fields):
    if not config_fields:
        return AutoModelForCausalLM.from_pretrained(path)
    config = AutoModelForCausalLM.from_pretrained(path).config
    for key, value in config_fields.items():
        setattr(config, key, value)
    torch.manual_seed(3)
    return AutoModelForCausalLM.from_config(config)


def _sample_both(model, tok, params, monkeypatch, num_generations=4):
    """The rollout with `generate` and with the fused loop (whose `generate` would raise), same seed."""
    said: list[str] = []
    plain = HFGenerationBackend(lambda: model, tok, params, record_logps=True)
    fused = HFGenerationBackend(lambda: model, tok, params, record_logps=True, fused_decode=True, say=said.append)
    torch.manual_seed(0)
    theirs = plain.generate(PROMPTS, num_generations)

    def refuse(*args, **kwargs):
        raise AssertionError("generate ran: the fused loop did not")

    monkeypatch.setattr(model, "generate", refuse)
    torch.manual_seed(0)
    ours = fused.generate(PROMPTS, num_generations)
    assert said == []
    return ours, theirs


@pytest.mark.parametrize("family", ["qwen2", "llama", "llama-linear-rope"])
@pytest.mark.parametrize("sampling", [dict(), dict(temperature=0.7, top_k=20, top_p=0.9, min_p=0.01)])
def test_the_fused_loop_samples_the_same_tokens_and_log_probs_as_generate(family, sampling, qwen2_model, llama_model,
                                                                           monkeypatch):
    path = qwen2_model if family == "qwen2" else llama_model
    extra = {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}} \
        if family == "llama-linear-rope" else {}
    model, tok = _model(path, **extra), AutoTokenizer.from_pretrained(path)
    ours, theirs = _sample_both(model, tok, SamplingParams(16, **sampling), monkeypatch)
    assert torch.equal(ours.completion_ids, theirs.completion_ids)
    assert torch.equal(ours.completion_mask, theirs.completion_mask)
    assert torch.allclose(ours.sampling_logps, theirs.sampling_logps, atol=1e-5)
    assert (ours.sampling_logps[ours.completion_mask.bool()] < 0).all()


def test_rows_stop_at_their_eos_and_the_loop_ends_when_every_row_has(qwen2_model, monkeypatch):
    """Many EOS ids: rows end at different steps, are padded after their EOS, and the loop stops before the limit."""
    model, tok = _model(qwen2_model), AutoTokenizer.from_pretrained(qwen2_model)
    eos_ids = tuple(range(3, len(tok), 6))  # a sixth of the vocabulary ends a completion
    ours, theirs = _sample_both(model, tok, SamplingParams(40, eos_token_ids=eos_ids), monkeypatch)
    lengths = ours.completion_mask.sum(-1)
    assert ours.terminated.all() and len(set(lengths.tolist())) > 1
    assert ours.completion_ids.size(1) == lengths.max() < 40  # stopped when the last row ended
    assert torch.equal(ours.completion_ids, theirs.completion_ids)
    assert torch.equal(ours.terminated, theirs.terminated)
    mask = ours.completion_mask.bool()
    assert torch.allclose(ours.sampling_logps[mask], theirs.sampling_logps[mask], atol=1e-5)


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_the_decode_step_gives_the_models_own_log_probs(family, qwen2_model, llama_model):
    path = qwen2_model if family == "qwen2" else llama_model
    model = _model(path)
    assert decode_step_difference(model, model.config.vocab_size) < 1e-5


def test_a_model_whose_forward_the_step_does_not_reproduce_decodes_with_generate_and_says_why(qwen2_model):
    model, tok = _model(qwen2_model), AutoTokenizer.from_pretrained(qwen2_model)
    model.model.layers[0].mlp.act_fn = torch.nn.GELU()  # the config still says silu; only the probe can tell
    said: list[str] = []
    params = SamplingParams(8)
    fused = HFGenerationBackend(lambda: model, tok, params, record_logps=True, fused_decode=True, say=said.append)
    plain = HFGenerationBackend(lambda: model, tok, params, record_logps=True)
    torch.manual_seed(0)
    ours = fused.generate(PROMPTS, 2)
    torch.manual_seed(0)
    assert torch.equal(ours.completion_ids, plain.generate(PROMPTS, 2).completion_ids)
    assert len(said) == 1 and "fused_decode: on a probe batch it is up to" in said[0]
    assert "decoding with HF generate" in said[0]
    fused.generate(PROMPTS, 2)
    assert len(said) == 1  # checked once


@pytest.mark.parametrize("change, expected", [
    (lambda m: m.to(torch.bfloat16), "not all float32"),
    (lambda m: setattr(m.generation_config, "no_repeat_ngram_size", 3), "generation_config sets no_repeat_ngram_size"),
    (lambda m: setattr(m.config, "hidden_act", "gelu"), "hidden_act 'gelu'"),
    (lambda m: setattr(m.config, "layer_types", ["sliding_attention"] * m.config.num_hidden_layers),
     "sliding-window"),
])
def test_models_and_settings_it_does_not_cover_are_named(change, expected, qwen2_model):
    model = _model(qwen2_model)
    assert unsupported_reason(model, None, 1.0) is None
    change(model)
    assert expected in unsupported_reason(model, None, 1.0)


def test_generation_kwargs_a_repetition_penalty_and_autocast_keep_generate(qwen2_model):
    model = _model(qwen2_model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert "autocast" in unsupported_reason(model, None, 1.0)
    assert "generation_kwargs ['min_new_tokens']" in unsupported_reason(model, {"min_new_tokens": 4}, 1.0)
    assert "repetition_penalty" in unsupported_reason(model, None, 1.1)
    with_mlp_bias = lm_config("llama", 64, 0, 1, 32, 2, mlp_bias=True)
    assert "bias" in unsupported_reason(AutoModelForCausalLM.from_config(with_mlp_bias), None, 1.0)


def test_a_lora_policy_decodes_with_generate(qwen2_model):
    from peft import LoraConfig, get_peft_model

    lora = get_peft_model(_model(qwen2_model), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    assert "a PEFT model (PeftModel)" in unsupported_reason(lora, None, 1.0)


@pytest.mark.parametrize("fused", [True, False])
def test_the_trainer_decodes_with_the_fused_loop_by_default(tmp_path, qwen2_model, fused, capfd):
    from rloo_engine.trainer import RLOOTrainer
    from tests.engine.helpers import read_metrics, tiny_config

    overrides = {} if fused else {"fused_decode": False}
    trainer = RLOOTrainer(tiny_config(tmp_path, qwen2_model, beta=0.05, max_steps=1, **overrides))
    trainer.train()
    assert trainer.backend._fused is fused
    assert "fused_decode:" not in capfd.readouterr().err
    assert read_metrics(tmp_path / "out")[0]["kl"] == pytest.approx(0.0, abs=1e-5)  # decoded log-probs = the forward's
