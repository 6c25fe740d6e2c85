"""Issue 47, "fewer passes": when a generation batch is one micro-batch, pi_old is the training forward's own
log-probs (the weights have not moved since sampling), so the KL comes from that forward and the separate no-grad
policy pass that TRL runs (`old_per_token_logps`) is skipped; everything the run computes stays the same."""

from __future__ import annotations

import pytest
import torch

from rloo_engine.testing.tiny_chat_models import build_chat_model
from rloo_engine.trainer import RLOOTrainer
from tests.engine.helpers import read_metrics, tiny_config

# sampling_logprobs: forward needs pi_old from a pass over the batch: the case the lever is for
SETTINGS = dict(beta=0.1, sampling_logprobs="forward", learning_rate=3e-2, max_steps=3)


def _policy_forwards(trainer: RLOOTrainer) -> list[bool]:
    """Records, for each forward of the policy module, whether autograd was recording it."""
    calls: list[bool] = []
    trainer.acc.unwrap_model(trainer.policy).register_forward_pre_hook(
        lambda module, args: calls.append(torch.is_grad_enabled()))
    return calls


def _train(tmp_path, model, from_training_forward: bool, **overrides) -> tuple[list[dict], list[bool]]:
    trainer = RLOOTrainer(tiny_config(tmp_path, model, fused_decode=False, **{**SETTINGS, **overrides}))
    assert trainer.kl_from_training_forward  # one micro-batch per generation batch, dropout off
    trainer.kl_from_training_forward = from_training_forward  # the path the other setting takes
    calls = _policy_forwards(trainer)
    trainer.train()
    return read_metrics(tmp_path / "out"), calls


def test_the_policy_no_grad_pass_is_skipped_and_the_run_is_the_same(tmp_path, qwen2_model):
    lever, lever_calls = _train(tmp_path / "lever", qwen2_model, True)
    plain, plain_calls = _train(tmp_path / "plain", qwen2_model, False)
    # Each step: generation (prefill + decode, no grad), then the plain path's pi_old pass (no grad, and its prompt
    # pass when prompts are shared), then the training forward. The lever drops exactly the pi_old pass.
    steps = SETTINGS["max_steps"]
    assert sum(lever_calls) == sum(plain_calls) > 0  # the same training forwards
    assert len(plain_calls) - len(lever_calls) >= steps  # at least one no-grad forward a step fewer
    for a, b in zip(lever, plain, strict=True):
        assert a["kl"] != 0.0 or a["step"] == 1
        for key in ("kl", "sequence_kl", "reward", "loss", "grad_norm", "entropy"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), (a["step"], key, a[key], b[key])
    assert lever[0]["kl"] == 0.0 and lever[0]["sequence_kl"] == 0.0  # step 1: the policy is its reference
    assert lever[-1]["sequence_kl"] != 0.0  # and then it moves


@pytest.mark.parametrize("flags", [dict(steps_per_generation=2, per_device_train_batch_size=4),
                                   dict(num_iterations=2)], ids=["two-micro-batches", "two-iterations"])
def test_the_pass_runs_where_the_training_forward_is_not_pi_old(tmp_path, qwen2_model, flags):
    cfg = tiny_config(tmp_path, qwen2_model, **{**SETTINGS, "max_steps": 1, **flags})
    assert not RLOOTrainer(cfg).kl_from_training_forward


def test_dropout_keeps_the_pass_unless_the_model_has_none(tmp_path, qwen2_model):
    """TRL's default disable_dropout: false leaves a dropout-free model (most current ones) on the lever; a model with
    attention dropout (applied functionally in training mode, not an nn.Dropout) keeps the eval-mode pass."""
    cfg = tiny_config(tmp_path, qwen2_model, **{**SETTINGS, "max_steps": 1, "disable_dropout": False})
    assert RLOOTrainer(cfg).kl_from_training_forward
    dropping = build_chat_model(tmp_path / "dropout_model", "qwen", attention_dropout=0.3)
    cfg = tiny_config(tmp_path / "d", dropping, **{**SETTINGS, "max_steps": 1, "disable_dropout": False})
    assert not RLOOTrainer(cfg).kl_from_training_forward
    cfg = tiny_config(tmp_path / "e", dropping, **{**SETTINGS, "max_steps": 1, "disable_dropout": True})
    assert not RLOOTrainer(cfg).kl_from_training_forward  # disable_dropout zeroes modules, not attention_dropout
