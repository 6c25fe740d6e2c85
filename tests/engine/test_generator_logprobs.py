"""The trainer with a generator that reports its own log-probs, as vLLM does (`Rollout.generator_logps`): the
mismatch metrics, pi_old always the trainer's own, and the importance weights in the loss. The generator here is
the HF backend with its fp32 decoding log-probs (~1e-6 from a forward) moved by a known offset, so each expected
number is known; real vLLM is in tests/with_vllm."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from rloo_engine.generation.base import Rollout
from rloo_engine.generation.hf import HFGenerationBackend
from rloo_engine.trainer import RLOOTrainer
from tests.engine.helpers import read_metrics, tiny_config


class ReportingGenerator:
    """Samples with the HF backend and reports log pi(o_t) - offset for each sampled token, like vLLM would."""

    def __init__(self, inner: HFGenerationBackend, offset: float):
        self.inner, self.offset = inner, offset

    def generate(self, prompts, num_generations, add_special_tokens=False) -> Rollout:
        rollout = self.inner.generate(prompts, num_generations, add_special_tokens)
        reported = (rollout.sampling_logps - self.offset) * rollout.completion_mask
        return replace(rollout, sampling_logps=None, generator_logps=reported)

    def sync_weights(self, model, **_) -> None:
        return None  # samples from the trainer's own model


def run(tmp_path, model, offset: float, **overrides) -> list[dict]:
    cfg = tiny_config(tmp_path, model, use_vllm=True, max_steps=2, **overrides)
    trainer = RLOOTrainer(cfg, backend=object())  # replaced below: no vLLM in this venv
    inner = HFGenerationBackend(lambda: trainer.acc.unwrap_model(trainer.policy), trainer.tokenizer,
                                trainer._sampling_params(), record_logps=True)
    trainer.backend = ReportingGenerator(inner, offset)
    trainer.train()
    return read_metrics(cfg.output_dir)


def test_an_agreeing_generator_gives_no_mismatch_and_weights_of_one(tmp_path, qwen2_model):
    """On-policy fp32, the trainer's forward and the decoding log-probs agree to ~1e-6: the weights are 1."""
    rows = run(tmp_path, qwen2_model, 0.0, vllm_importance_sampling_correction=True,
               vllm_importance_sampling_mode="token_truncate")
    for r in rows:
        assert r["vllm/logprob_diff_mean"] < 1e-5 and r["vllm/logprob_diff_max"] < 1e-5
        for k in ("min", "mean", "max"):
            assert r[f"sampling/importance_sampling_ratio/{k}"] == pytest.approx(1.0, abs=1e-5)


def test_the_mismatch_is_logged_without_the_correction_and_never_becomes_pi_old(tmp_path, qwen2_model):
    """Off-policy (num_iterations 2), old log-probs matter. Were the generator's (0.3 per token lower) taken as
    pi_old, every ratio would be e^{0.3 * length} and clipped; the run equals one whose generator agrees."""
    off = run(tmp_path / "off", qwen2_model, 0.3, num_iterations=2)
    exact = run(tmp_path / "exact", qwen2_model, 0.0, num_iterations=2)
    for r in off:
        assert r["vllm/logprob_diff_mean"] == pytest.approx(0.3, abs=1e-4)
        assert r["vllm/logprob_diff_max"] == pytest.approx(0.3, abs=1e-4)
        assert not any(k.startswith("sampling/importance_sampling_ratio") for k in r)
    for a, b in zip(off, exact):
        assert (a["grad_norm"], a["loss"], a["clip_ratio/region_mean"]) == pytest.approx(
            (b["grad_norm"], b["loss"], b["clip_ratio/region_mean"]), rel=1e-5, abs=1e-7)


def test_token_weights_scale_the_gradient_and_mask_modes_remove_it(tmp_path, qwen2_model):
    """On-policy rho = 1, so the gradient is A * sum_t w_t grad log pi: a weight of e^0.3 on every token
    scales the step-1 gradient norm by e^0.3; masking every token (clip_max below e^0.3) removes it."""
    plain = run(tmp_path / "plain", qwen2_model, 0.3)
    weighted = run(tmp_path / "weighted", qwen2_model, 0.3, vllm_importance_sampling_correction=True,
                   vllm_importance_sampling_mode="token_truncate")
    masked = run(tmp_path / "masked", qwen2_model, 0.3, vllm_importance_sampling_correction=True,
                 vllm_importance_sampling_mode="token_mask", vllm_importance_sampling_clip_max=1.2)
    assert weighted[0]["sampling/importance_sampling_ratio/mean"] == pytest.approx(math.exp(0.3), abs=1e-4)
    assert weighted[0]["grad_norm"] == pytest.approx(math.exp(0.3) * plain[0]["grad_norm"], rel=1e-4)
    assert weighted[0]["loss"] == pytest.approx(plain[0]["loss"], rel=1e-6, abs=1e-9)  # the value is unchanged
    assert masked[0]["sampling/importance_sampling_ratio/max"] == 0.0
    assert masked[0]["grad_norm"] == 0.0


def test_the_ratio_anchored_at_vllms_log_probs_weights_inside_the_clip_cuts_outside_and_masks(tmp_path, qwen2_model):
    """rho = pi_theta / pi_vllm = e^{offset * length} at step 1. 0.02 a token keeps every rho inside [0.8, 1.2]:
    the same gradient as pi_old's anchor with the same sequence weights. 0.1 a token puts completions of 2+
    tokens past 1.2: the clip acts, where pi_old's anchor (rho = 1) never does. A mask below e^0.3 removes all."""
    anchors = dict(vllm_importance_sampling_correction=True, vllm_importance_sampling_mode="sequence_mask")
    inside = run(tmp_path / "inside", qwen2_model, 0.02, ratio_anchor="vllm", **anchors)
    weighted = run(tmp_path / "weighted", qwen2_model, 0.02, ratio_anchor="old_policy", **anchors)
    assert inside[0]["grad_norm"] == pytest.approx(weighted[0]["grad_norm"], rel=1e-4)
    assert inside[0]["clip_ratio/region_mean"] == 0.0
    past = run(tmp_path / "past", qwen2_model, 0.1, ratio_anchor="vllm", vllm_importance_sampling_clip_max=None,
               **anchors)
    plain = run(tmp_path / "plain", qwen2_model, 0.1, ratio_anchor="old_policy", vllm_importance_sampling_clip_max=None,
                **anchors)
    assert past[0]["clip_ratio/high_mean"] > 0 and plain[0]["clip_ratio/region_mean"] == 0.0
    masked = run(tmp_path / "masked", qwen2_model, 0.3, ratio_anchor="vllm", vllm_importance_sampling_clip_max=1.2,
                 **anchors)
    assert masked[0]["grad_norm"] == 0.0 and masked[0]["loss"] == 0.0
