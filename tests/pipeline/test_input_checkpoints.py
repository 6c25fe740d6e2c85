"""Checkpoint ingestion and reward probing: load checks without weights, digests, clear rejections."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from rloo_engine.config_base import ConfigError
from rloo_engine.pipeline.config import DataSection, RewardSection
from rloo_engine.pipeline.input_checkpoints import content_digest, inspect_checkpoint, materialize_source, source_kind
from rloo_engine.pipeline.reward_probe import probe_rewards
from rloo_engine.reward_sources import RewardError
from rloo_engine.testing import tiny_models


def test_facts_of_a_causal_lm(qwen2_model):
    from transformers import AutoModelForCausalLM

    facts = inspect_checkpoint(Path(qwen2_model), "causal_lm", "sft.source")
    model = AutoModelForCausalLM.from_pretrained(qwen2_model)
    assert facts.architecture == "Qwen2ForCausalLM" and facts.model_type == "qwen2"
    assert facts.num_parameters == sum(p.numel() for p in model.parameters())  # tied lm_head counted once
    assert facts.dtype == "float32"
    assert (facts.pad_token, facts.eos_token, facts.has_chat_template) == ("<pad>", "<eos>", True)
    assert facts.weight_files == ["model.safetensors"]


def test_inspection_never_reads_the_weights(qwen2_model, tmp_path):
    # Cut the tensor data off after the safetensors header: loading the weights would fail, the inspection
    # (meta-device model vs. header shapes) does not notice, because it never reads them.
    ckpt = Path(shutil.copytree(qwen2_model, tmp_path / "headers_only"))
    weights = ckpt / "model.safetensors"
    raw = weights.read_bytes()
    header_end = 8 + int.from_bytes(raw[:8], "little")
    weights.write_bytes(raw[:header_end])
    facts = inspect_checkpoint(ckpt, "causal_lm", "sft.source")
    assert facts.num_parameters == inspect_checkpoint(Path(qwen2_model), "causal_lm", "sft.source").num_parameters


def test_digest_follows_the_weights_not_the_location(qwen2_model, tmp_path):
    copy = Path(shutil.copytree(qwen2_model, tmp_path / "copy"))
    (copy / "README.md").write_text("notes do not change the digest")
    assert content_digest(copy) == content_digest(Path(qwen2_model))
    from safetensors.torch import load_file, save_file

    state = load_file(copy / "model.safetensors")
    state["model.norm.weight"] = state["model.norm.weight"] + 1
    save_file(state, copy / "model.safetensors", metadata={"format": "pt"})
    assert content_digest(copy) != content_digest(Path(qwen2_model))


def test_wrong_kind_and_mismatched_checkpoints_are_rejected(qwen2_model, reward_model, tmp_path):
    with pytest.raises(
        ConfigError, match=r"sft.source: .* does not have, e.g. \['score.weight'\]; is this the right kind"
    ):
        inspect_checkpoint(Path(reward_model), "causal_lm", "sft.source")
    with pytest.raises(
        ConfigError, match=r"reward.model: .*weights lack 1 tensors of the model, e.g. \['score.weight'\]"
    ):
        inspect_checkpoint(Path(qwen2_model), "reward_model", "reward.model")
    wrong = Path(shutil.copytree(qwen2_model, tmp_path / "wrong_shape"))
    config = json.loads((wrong / "config.json").read_text())
    config["intermediate_size"] *= 2
    (wrong / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        ConfigError,
        match=r"weight shapes do not match the config: \['model.layers.0.mlp.gate_proj.weight "
        r"\(64, 32\) != \(128, 32\)",
    ):
        inspect_checkpoint(wrong, "causal_lm", "sft.source")


def test_sources_are_classified_and_missing_paths_named(tmp_path):
    assert source_kind("models:/tldr-sft@production") == "mlflow"
    assert source_kind("runs:/0123/policy") == "mlflow"
    assert source_kind("Qwen/Qwen2.5-0.5B") == "hub"
    assert source_kind(str(tmp_path)) == "local"
    with pytest.raises(ConfigError, match=r"sft.source: /no/such/ckpt does not exist; expected a checkpoint directory"):
        materialize_source("/no/such/ckpt", "sft.source", tmp_path / "dl")
    with pytest.raises(ConfigError, match="is not a local path, and downloading it as a hub model failed"):
        materialize_source("nobody/nothing-here", "sft.source", tmp_path / "dl")  # offline in tests


def reward_section(**kw) -> RewardSection:
    return RewardSection(**kw)


@pytest.fixture(scope="module")
def probe_data(tmp_path_factory) -> DataSection:
    root = tmp_path_factory.mktemp("probe")
    prompts = tiny_models.write_prompt_file(root / "prompts.jsonl", num_prompts=12)
    return DataSection(train_prompts=str(prompts), eval_prompts=str(prompts))


def test_probe_scores_every_source(qwen2_model, reward_model, probe_data):
    reward = reward_section(model=str(reward_model), functions=["rloo_engine.reward_functions:char_fraction"])
    stats, table = probe_rewards(reward, probe_data, str(qwen2_model), str(reward_model))
    assert set(stats) == {"reward_model", "char_fraction"}
    assert stats["reward_model"].n_scored == 8 and stats["reward_model"].std > 0
    assert len(table["completion"]) == 8 and len(table["reward_model"]) == 8


def _reward_model_with_head(src: str, dst: Path, fill: float) -> Path:
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(src)
    with torch.no_grad():
        model.score.weight.fill_(fill)
    model.save_pretrained(dst)
    shutil.copy(Path(src) / "tokenizer.json", dst)
    shutil.copy(Path(src) / "tokenizer_config.json", dst)
    return dst


def test_constant_and_nan_reward_models_are_rejected(qwen2_model, reward_model, probe_data, tmp_path):
    constant = _reward_model_with_head(reward_model, tmp_path / "constant", 0.0)
    with pytest.raises(ConfigError, match=r"reward.model: .* gave every probe completion the same score \(0\)"):
        probe_rewards(reward_section(model=str(constant)), probe_data, str(qwen2_model), str(constant))
    nan = _reward_model_with_head(reward_model, tmp_path / "nan", float("nan"))
    with pytest.raises(ConfigError, match=r"reward.model: .* returned NaN for 8 probe completions"):
        probe_rewards(reward_section(model=str(nan)), probe_data, str(qwen2_model), str(nan))


def test_reward_functions_must_import_and_return_floats(qwen2_model, probe_data):
    with pytest.raises(ConfigError, match="reward_funcs: no_such_module:f: module 'no_such_module' not found"):
        probe_rewards(reward_section(functions=["no_such_module:f"]), probe_data, str(qwen2_model), None)
    with pytest.raises(
        RewardError, match=r"reward_funcs\[0\] .*words returned a str at row 0; expected a float or None"
    ):
        probe_rewards(
            reward_section(functions=["tests.pipeline.test_input_checkpoints:words"]), probe_data, str(qwen2_model), None
        )


def words(completions, **_):
    """A broken reward function: text instead of scores."""
    return [c.split()[0] if c.split() else "" for c in completions]


def test_a_vision_language_checkpoint_is_ingested_as_a_policy(tmp_path):
    """Its weights are saved under the original layout (`language_model.model.*`, renamed as transformers loads
    them), so they are checked by size; its processor must load, as the trainer loads it."""
    from transformers import AutoModelForImageTextToText

    from rloo_engine.testing.tiny_vlm import build_vlm

    vlm = build_vlm(tmp_path / "llava", "llava")
    facts = inspect_checkpoint(vlm, "causal_lm", "sft.source")
    model = AutoModelForImageTextToText.from_pretrained(vlm)
    assert (facts.architecture, facts.model_type, facts.vision_language) == ("LlavaForConditionalGeneration",
                                                                             "llava", True)
    assert facts.num_parameters == model.num_parameters()  # the tied head once
    assert facts.vocab_size == model.config.text_config.vocab_size
    wrong = Path(shutil.copytree(vlm, tmp_path / "wrong"))
    config = json.loads((wrong / "config.json").read_text())
    config["text_config"]["intermediate_size"] *= 2
    (wrong / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=r"sft.source: .*wrong: weights hold [\d,]+ elements and a "
                                          r"LlavaForConditionalGeneration of its config has [\d,]+"):
        inspect_checkpoint(wrong, "causal_lm", "sft.source")
    (wrong / "config.json").write_text((vlm / "config.json").read_text())
    (wrong / "processor_config.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"sft.source: .* a vision-language model \(llava\) whose processor does "
                                          "not load"):
        inspect_checkpoint(wrong, "causal_lm", "sft.source")


def image_path_length(completions, image, **kwargs) -> list[float]:
    """A reward function of the VLM probe test: it reads the dataset's `image` column, as TRL passes it."""
    return [float(len(path)) for path in image]


def test_the_reward_check_probes_with_a_vision_language_policy_and_image_rows(tmp_path):
    from rloo_engine.testing.tiny_vlm import build_vlm, image

    vlm = build_vlm(tmp_path / "llava", "llava")
    rows = []
    for k in range(8):
        path = tmp_path / f"picture-{'x' * k}.png"
        image(k).save(path)
        rows.append({"prompt": [{"role": "user", "content": f"picture {k}"}], "image": str(path)})
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    reward = reward_section(functions=[f"{__name__}:image_path_length"])
    stats, table = probe_rewards(reward, DataSection(train_prompts=str(data), eval_prompts=str(data)), str(vlm), None)
    assert stats["image_path_length"].n_scored == 8 and stats["image_path_length"].std > 0  # each row's own image
