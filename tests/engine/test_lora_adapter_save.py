"""A LoRA run saves its adapter in PEFT layout as `final/` (as TRL does); `save_merged_model` adds `final-merged/`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from rloo_engine.config_base import ConfigError
from rloo_engine.trainer import RLOOTrainer
from tests.engine.helpers import tiny_config

peft = pytest.importorskip("peft")

LORA = dict(use_peft=True, lora_r=4, lora_alpha=8, lora_target_modules=["q_proj", "v_proj"], learning_rate=5e-2)
PROBE = torch.tensor([[5, 17, 23, 42, 8, 99, 3, 61]])


def logits(model: torch.nn.Module) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=PROBE).logits


def trained_lora_run(tmp_path: Path, qwen2_model: Path, **extra) -> tuple[RLOOTrainer, Path]:
    cfg = tiny_config(tmp_path, qwen2_model, **LORA, max_steps=3, save_steps=2, **extra)
    trainer = RLOOTrainer(cfg)
    trainer.train()
    return trainer, Path(cfg.output_dir)


def test_final_is_a_peft_adapter_whose_outputs_are_the_trained_policys(tmp_path, qwen2_model):
    trainer, out = trained_lora_run(tmp_path, qwen2_model)
    final = out / "final"
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json"} <= {p.name for p in final.iterdir()}
    assert not (final / "model.safetensors").exists()  # the adapter, not a merged copy of the base
    assert not (out / "final-merged").exists()
    # The intermediate checkpoint holds the same layout (and is what a resume reads).
    assert (out / "checkpoint-2" / "adapter_model.safetensors").is_file()

    adapted = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(qwen2_model), final)
    policy = trainer.acc.unwrap_model(trainer.policy)
    torch.testing.assert_close(logits(adapted), logits(policy), rtol=0, atol=0)
    # The adapter did learn something: without it the outputs are the base's.
    assert not torch.equal(logits(AutoModelForCausalLM.from_pretrained(qwen2_model)), logits(policy))


def test_save_merged_model_also_writes_a_merged_copy_that_agrees_with_the_adapter(tmp_path, qwen2_model):
    trainer, out = trained_lora_run(tmp_path, qwen2_model, save_merged_model=True)
    merged = AutoModelForCausalLM.from_pretrained(out / "final-merged")
    assert not any("lora" in name for name, _ in merged.named_parameters())
    assert (out / "final-merged" / "tokenizer.json").is_file()
    adapted = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(qwen2_model), out / "final")
    torch.testing.assert_close(logits(merged), logits(adapted), rtol=0, atol=1e-5)  # merging rounds once
    torch.testing.assert_close(logits(merged), logits(trainer.acc.unwrap_model(trainer.policy)), rtol=0, atol=1e-5)


def test_save_merged_model_without_lora_is_refused_by_name(tmp_path, qwen2_model):
    with pytest.raises(ConfigError, match="save_merged_model: true without use_peft"):
        tiny_config(tmp_path, qwen2_model, save_merged_model=True)
