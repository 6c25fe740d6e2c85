"""`generation_dtype: bfloat16` (issue 47, "bf16 decoding with exact pi_old"): a float32 policy decodes in the fused loop
on bf16 copies of its weights; its decoding log-probs are a sampler's (compared with pi_old, optionally importance
weights), never pi_old, which comes from the float32 training forward, so step-1 KL stays exactly 0."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rloo_engine.config_base import ConfigError
from rloo_engine.generation.base import SamplingParams
from rloo_engine.generation.fused_decode import FusedDecoder
from rloo_engine.generation.hf import HFGenerationBackend
from rloo_engine.trainer import RLOOTrainer
from tests.engine.helpers import read_metrics, tiny_config

PROMPTS = ["the cat sat on the mat and", "a dog", "once upon a time there was a little"]  # left-padded


def _backend(path, **kwargs):
    model, tok = AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    return model, HFGenerationBackend(lambda: model, tok, SamplingParams(12), **kwargs)


def test_bf16_decoding_reports_a_samplers_log_probs_close_to_the_policys(qwen2_model):
    model, backend = _backend(qwen2_model, fused_decode=True, decode_dtype=torch.bfloat16)
    torch.manual_seed(0)
    rollout = backend.generate(PROMPTS, 4)
    assert rollout.sampling_logps is None  # not pi_old
    assert rollout.generator_logps is not None and not rollout.generator_logps_processed
    mask = rollout.completion_mask.bool()
    # the float32 policy's own log-probs of the same tokens
    ids = torch.cat([rollout.prompt_ids, rollout.completion_ids], 1)
    attention = torch.cat([rollout.prompt_mask, rollout.completion_mask], 1)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attention,
                       position_ids=(attention.cumsum(-1) - 1).clamp(min=0)).logits[:, rollout.prompt_ids.size(1) - 1:-1]
    exact = torch.log_softmax(logits.float(), -1).gather(-1, rollout.completion_ids.unsqueeze(-1)).squeeze(-1)
    difference = (exact - rollout.generator_logps)[mask].abs()
    assert 0 < difference.max() < 0.1  # bf16 rounding: close, not equal
    assert (rollout.generator_logps[mask] < 0).all()


def test_the_decoder_holds_bf16_weights_and_casts_the_prefill_cache(qwen2_model):
    model = AutoModelForCausalLM.from_pretrained(qwen2_model)
    decoder = FusedDecoder(model, 32, dtype=torch.bfloat16)
    norm1, qkv, _, _, o_w, _, norm2, gate_up, down = decoder.layers[0]
    assert {t.dtype for t in (norm1[0], qkv, o_w, norm2[0], gate_up, down, decoder.head)} == {torch.bfloat16}
    assert decoder.embed.dtype == torch.float32  # the table stays; a step casts the rows it looks up
    assert all(p.dtype == torch.float32 for p in model.parameters())  # the policy itself is untouched


def test_without_the_fused_loop_it_samples_in_the_policys_dtype_and_says_so(qwen2_model):
    said: list[str] = []
    _, backend = _backend(qwen2_model, fused_decode=False, decode_dtype=torch.bfloat16, say=said.append)
    rollout = backend.generate(PROMPTS, 2)
    assert rollout.generator_logps is None
    assert said == ["generation_dtype: bfloat16 decodes in the fused loop, and fused_decode is off: sampling in the "
                    "policy's dtype"]


def test_a_bf16_decoding_run_keeps_pi_old_exact_and_weights_the_update(tmp_path, qwen2_model):
    cfg = tiny_config(tmp_path, qwen2_model, generation_dtype="bfloat16", vllm_importance_sampling_correction=True,
                      beta=0.1, learning_rate=3e-2, max_steps=3)
    trainer = RLOOTrainer(cfg)
    assert trainer.kl_from_training_forward and not cfg.logprobs_from_generation
    trainer.train()
    rows = read_metrics(tmp_path / "out")
    assert rows[0]["kl"] == 0.0 and rows[0]["sequence_kl"] == 0.0  # pi_old is the float32 forward, not bf16's
    assert rows[-1]["sequence_kl"] != 0.0
    for row in rows:
        assert 0 < row["bf16_decoding/logprob_diff_mean"] < 0.05
        assert 0.5 < row["sampling/importance_sampling_ratio/mean"] < 2.0
        assert "vllm/logprob_diff_mean" not in row


@pytest.mark.parametrize("flags, expected", [
    (dict(use_vllm=True), "generation_dtype: 'bfloat16' with use_vllm: true; vLLM samples in its own dtype"),
    (dict(bf16=True), "generation_dtype: 'bfloat16' with dtype: float32, bf16: true, fp16: false; it decodes a "
                      "float32 policy in bfloat16"),
    (dict(dtype="bfloat16"), "generation_dtype: 'bfloat16' with dtype: bfloat16"),
    (dict(sampling_logprobs="generation"), "generation_dtype: 'bfloat16' with sampling_logprobs: 'generation'; the "
                                           "bf16 decoding log-probs are not the float32 policy's pi_old"),
])
def test_settings_it_cannot_serve_are_refused_at_the_config(tmp_path, qwen2_model, flags, expected):
    with pytest.raises(ConfigError, match=expected.replace("(", r"\(")):
        tiny_config(tmp_path, qwen2_model, generation_dtype="bfloat16", **flags)


def test_importance_weights_without_another_sampler_are_still_refused(tmp_path, qwen2_model):
    with pytest.raises(ConfigError, match="without use_vllm: true or generation_dtype: bfloat16"):
        tiny_config(tmp_path, qwen2_model, vllm_importance_sampling_correction=True)
