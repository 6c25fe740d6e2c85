"""A LoRA policy through the pipeline: the engine is asked for the merged copy, and the registry registers that
whole model (servable by MLflow without the base), tagged `rloo.weights: lora-merged` with its adapter named."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from rloo_engine.pipeline.config import build_pipeline_config
from rloo_engine.pipeline.policy_model import PREDICT_PARAMS
from rloo_engine.trainer import RLOOTrainer
from tests.engine.helpers import tiny_config
from tests.pipeline.test_config import config
from tests.pipeline.test_registry import ingested, promote_flow

pytest.importorskip("peft")


def test_a_lora_pipeline_asks_the_engine_for_the_merged_copy_and_keeps_mlflow():
    lora = build_pipeline_config(config(train__use_peft=True, train__report_to="tensorboard"))
    engine = lora.engine_config(sft_path="org/sft", reward_model_path="org/rm", output_dir="/runs/1/train", run_name="r")
    assert engine.save_merged_model and engine.report_to == ["mlflow", "tensorboard"]
    full = build_pipeline_config(config()).engine_config(
        sft_path="org/sft", reward_model_path="org/rm", output_dir="/runs/1/train", run_name="r")
    assert not full.save_merged_model and full.report_to == ["mlflow"]


@pytest.mark.slow
def test_a_lora_policy_is_registered_merged_servable_and_tagged(services, qwen2_model, tmp_path, monkeypatch):
    import mlflow.pyfunc

    from rloo_engine.pipeline.config import PromotionGate, TrackingSection

    cfg = tiny_config(tmp_path, qwen2_model, use_peft=True, lora_r=4, lora_alpha=8, learning_rate=5e-2,
                      lora_target_modules=["q_proj", "v_proj"], max_steps=2, save_merged_model=True, report_to="none")
    RLOOTrainer(cfg).train()
    out = Path(cfg.output_dir)
    name = "tiny-lora-policy"
    tracking_cfg = TrackingSection(registered_model=name, promotion=PromotionGate(min_ci_low=0.5, alias="candidate"))
    flow = promote_flow(services, tracking_cfg, out / "final-merged", ingested(Path(qwen2_model)), tmp_path,
                        adapter_dir=out / "final")
    with services.prefect_settings():
        promotion, _, _ = flow()
    assert promotion.registered

    client = services.mlflow()
    version = client.get_model_version_by_alias(name, "candidate")
    assert version.tags["rloo.weights"] == "lora-merged" and version.tags["rloo.adapter_dir"] == str(out / "final")
    assert "LoRA adapter merged into the SFT base" in version.description
    model = client.get_logged_model(version.source.removeprefix("models:/"))
    assert model.tags["rloo.weights"] == "lora-merged"

    monkeypatch.setenv("MLFLOW_TRACKING_URI", services.mlflow_uri)
    loaded = mlflow.pyfunc.load_model(f"models:/{name}@candidate")
    prompts = ["the quick brown", "a lazy dog"]
    served = loaded.predict(prompts, params={**PREDICT_PARAMS, "max_new_tokens": 5})
    # The served model is the merged policy: greedy completions equal the merged directory's own.
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out / "final-merged")
    merged = AutoModelForCausalLM.from_pretrained(out / "final-merged").eval()
    for prompt, completion in zip(prompts, served):
        ids = tok(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            greedy = merged.generate(ids, max_new_tokens=5, do_sample=False)
        assert completion == tok.decode(greedy[0, ids.shape[1]:], skip_special_tokens=True)
