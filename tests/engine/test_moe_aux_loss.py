"""Issue 43, Mixture of Experts: the router's load-balancing loss weighted as TRL weighs it (`router_aux_loss_coef`,
else the architecture's own coefficient), logged as `aux_loss`, and refused on a dense model."""

from __future__ import annotations

import pytest
from transformers import AutoConfig

from rloo_engine.config_base import ConfigError
from rloo_engine.testing.tiny_chat_models import build_family_model
from rloo_engine.trainer import RLOOTrainer
from tests.engine.helpers import prompt_file, read_metrics, tiny_config


def _train(tmp_path, model, **overrides):
    cfg = tiny_config(tmp_path, model, dataset_name=str(prompt_file(tmp_path, n=8, conversational=True)),
                      max_steps=2, beta=0.05, per_device_train_batch_size=4, logging_steps=1,
                      sampling_logprobs="forward", **overrides)
    RLOOTrainer(cfg).train()
    return read_metrics(cfg.output_dir)


@pytest.mark.parametrize("family", ["qwen2_moe", "qwen3_moe", "mixtral"])
def test_the_load_balancing_loss_is_added_with_the_models_own_coefficient_and_logged(tmp_path, family):
    model = build_family_model(tmp_path / "model", family)
    own = AutoConfig.from_pretrained(model).router_aux_loss_coef
    assert own > 0
    default = _train(tmp_path / "default", model)
    off = _train(tmp_path / "off", model, router_aux_loss_coef=0.0)
    doubled = _train(tmp_path / "doubled", model, router_aux_loss_coef=2 * own)
    assert all(row["aux_loss"] > 0 for row in default) and "aux_loss" not in off[0]
    # step 1: the same weights and batch in every run, so the losses differ by exactly the weighted aux loss
    aux = default[0]["aux_loss"]
    assert default[0]["loss"] - off[0]["loss"] == pytest.approx(own * aux, rel=1e-4, abs=1e-7)
    assert doubled[0]["loss"] - off[0]["loss"] == pytest.approx(2 * own * aux, rel=1e-4, abs=1e-7)


def test_a_coefficient_on_a_dense_model_is_refused_naming_the_field(tmp_path, qwen2_model):
    with pytest.raises(ConfigError, match=r"router_aux_loss_coef: 0.01 but Qwen2ForCausalLM is not a Mixture-of-Experts"):
        _train(tmp_path, qwen2_model, router_aux_loss_coef=0.01)
    assert "aux_loss" not in _train(tmp_path / "dense", qwen2_model)[0]  # unset on a dense model: nothing to add


def test_lora_on_a_mixture_of_experts_keeps_the_load_balancing_loss(tmp_path):
    model = build_family_model(tmp_path / "model", "qwen2_moe")
    rows = _train(tmp_path / "lora", model, use_peft=True, lora_r=4, lora_alpha=8,
                  lora_target_modules=["q_proj", "v_proj"])
    assert all(row["aux_loss"] > 0 for row in rows)
