"""Vision-language models (issue 49): a dataset whose rows hold a chat prompt and an image trains a random-init LLaVA
end to end through `RLOOTrainer(model=..., train_dataset=...)`, as TRL's RLOOTrainer takes it: each row keeps its own
pixel inputs through generation, the log-prob passes and the micro-batches; the reward functions get the images as
TRL passes them (the `image` column); step 1's KL is exactly 0; a run killed mid-batch resumes exactly.

Qwen2-VL and Qwen2.5-VL (positions from a multimodal rotary index the model computes) need torchvision for their
processor, which this project's CPU torch 2.13.0 cannot load beside it: they run in the vision lane,
`scripts/test_vision_models.sh` (torch 2.14.1 with its torchvision), which fails on any skipped test."""

from __future__ import annotations

import json
import re
from pathlib import Path

import datasets
import numpy
import PIL.Image
import pytest
import torch
from transformers import AutoModelForImageTextToText, AutoProcessor

from rloo_engine.config import RLOOConfig
from rloo_engine.config_base import ConfigError
from rloo_engine.run.fault_injection import CRASH_ENV, CRASH_EXIT_CODE
from rloo_engine.testing.tiny_vlm import build_vlm, image, unavailable_reason
from rloo_engine.trainer import RLOOTrainer
from rloo_engine.vision import encode_prompts, numbers_own_positions
from tests.engine.helpers import read_metrics

G = 4
SIDE = 56  # pixels: Qwen's processor takes no smaller image; LLaVA's resizes it to its 28
# family -> (LoRA targets on the language and projection layers, the model's parts every run must train)
FAMILIES = {
    "llava": (["q_proj", "v_proj", "linear_1", "linear_2"], {"vision_tower", "multi_modal_projector", "language_model"}),
    "idefics3": (["q_proj", "v_proj", "modality_projection.proj"], {"vision_model", "connector", "text_model"}),
    "qwen2_vl": (["q_proj", "v_proj", "mlp.0", "mlp.2"], {"visual", "language_model"}),
    "qwen2_5_vl": (["q_proj", "v_proj", "mlp.0", "mlp.2"], {"visual", "language_model"}),
}
seen_by_reward: list[dict] = []


# Qwen2-VL / Qwen2.5-VL need torchvision (scripts/test_vision_models.sh runs them, and fails on a skip); Idefics3's
# PIL image processor needs it too before transformers 5.18 (the oldest-transformers lane skips it there).
FAMILY_PARAMS = [pytest.param(f, marks=pytest.mark.skipif(unavailable_reason(f) is not None,
                                                         reason=str(unavailable_reason(f))))
                 for f in FAMILIES]


def picture_number(prompts, completions, image, **_) -> list[float]:
    """A reward that reads the images: it records which picture each row's prompt names and the image it got."""
    seen_by_reward.append({"prompts": prompts, "image": image})
    return [float(numpy.asarray(i, dtype=numpy.float32).mean() / 255) + len(c[0]["content"]) / 100
            for i, c in zip(image, completions)]


@pytest.fixture(scope="module")
def vlms(tmp_path_factory) -> dict[str, Path]:
    root, built = tmp_path_factory.mktemp("vlms"), {}

    def get(family: str) -> Path:
        if family not in built:
            built[family] = build_vlm(root / family, family)
        return built[family]

    return get


@pytest.fixture(scope="module")
def llava(vlms) -> Path:
    return vlms("llava")


def picture_rows(n: int = 8) -> datasets.Dataset:
    """Chat prompts naming their picture, each with its own random image (a datasets.Image column)."""
    return datasets.Dataset.from_list([{"prompt": [{"role": "user", "content": f"picture {k}"}],
                                        "image": image(k, SIDE)} for k in range(n)])


def args(out: Path, **overrides) -> RLOOConfig:
    values = dict(output_dir=str(out), num_generations=G, per_device_train_batch_size=4, steps_per_generation=2,
                  num_iterations=2, max_completion_length=6, max_prompt_length=64, learning_rate=1e-3, beta=0.05,
                  max_steps=4, save_steps=2, logging_steps=1, disable_tqdm=True, disable_dropout=True,
                  sampling_logprobs="forward", report_to=[], seed=0)
    return RLOOConfig(**{**values, **overrides})


def train(model: Path, out: Path, resume=None, **overrides) -> RLOOTrainer:
    trainer = RLOOTrainer(model=str(model), reward_funcs=picture_number, args=args(out, **overrides),
                          train_dataset=picture_rows())
    trainer.train(resume_from_checkpoint=resume)
    return trainer


@pytest.mark.parametrize("family", FAMILY_PARAMS)
def test_each_row_keeps_its_own_image_through_generation_and_the_loss(family, vlms, tmp_path, capfd):
    model = vlms(family)
    seen_by_reward.clear()
    trainer = train(model, tmp_path / "out", max_steps=2, save_steps=0)
    assert f"{family} is a vision-language model" in capfd.readouterr().err  # the fast paths it runs without
    processor = AutoProcessor.from_pretrained(model)
    batch = trainer.batch
    assert batch.vision.own_positions == family.startswith("qwen")  # the multimodal rotary index: no 1-D positions
    prompts = trainer.tokenizer.batch_decode(batch.input_ids[:, :batch.prompt_length], skip_special_tokens=True)
    for row, prompt in enumerate(prompts):
        k = int(re.search(r"picture (\d+)", prompt).group(1))
        expected = processor(images=[image(k, SIDE)], text=[processor.image_token], return_tensors="pt")
        got = batch.vision.rows(slice(row, row + 1)).fields
        # per image or patch; per token (Qwen's mm_token_type_ids), aligned with the row's own prompt ids
        assert set(got) | set(batch.vision.token_fields) == set(expected) - {"input_ids", "attention_mask"}
        for name, tensor in got.items():
            torch.testing.assert_close(tensor, expected[name], rtol=0, atol=0)
    # The reward functions get the dataset's image column, each image G times, beside its own prompt.
    for call in seen_by_reward:
        assert len(call["image"]) == len(call["prompts"])
        for prompt, picture in zip(call["prompts"], call["image"]):
            k = int(re.search(r"picture (\d+)", prompt[0]["content"]).group(1))
            assert numpy.array_equal(numpy.asarray(picture), numpy.asarray(image(k, SIDE)))
    # The images reach the model: the same batch scored with the rows' images swapped gives other log-probs.
    from rloo_engine.logprobs import batched_token_logps

    policy = trainer.acc.unwrap_model(trainer.policy).eval()
    own = batched_token_logps(policy, batch.input_ids, batch.attention_mask, batch.prompt_length, 1.0, 4,
                              vision=batch.vision)
    swapped = batch.vision.rows(slice(None))
    swapped.fields["pixel_values"] = swapped.fields["pixel_values"].flip(0)  # images (LLaVA) or patches (Qwen)
    other = batched_token_logps(policy, batch.input_ids, batch.attention_mask, batch.prompt_length, 1.0, 4,
                                vision=swapped)
    assert (own - other).abs().max() > 1e-4


@pytest.mark.parametrize("family", FAMILY_PARAMS)
def test_a_vlm_starts_at_kl_0_and_resumes_exactly_after_a_crash(family, vlms, tmp_path, monkeypatch):
    model = vlms(family)
    train(model, tmp_path / "a")
    monkeypatch.setenv(CRASH_ENV, "2")  # dies right after the step-2 checkpoint, inside a generation batch
    with pytest.raises(SystemExit) as exit_info:
        train(model, tmp_path / "b")
    assert exit_info.value.code == CRASH_EXIT_CODE
    monkeypatch.delenv(CRASH_ENV)
    train(model, tmp_path / "b", resume="latest")

    for saved in (tmp_path / "a" / "final", tmp_path / "b" / "checkpoint-2"):  # the processor beside the model
        assert type(AutoProcessor.from_pretrained(saved)) is type(AutoProcessor.from_pretrained(model))
    a = AutoModelForImageTextToText.from_pretrained(tmp_path / "a" / "final")
    b = AutoModelForImageTextToText.from_pretrained(tmp_path / "b" / "final")
    before = AutoModelForImageTextToText.from_pretrained(model)
    changed = set()
    for (name, pa), (_, pb), (_, p0) in zip(a.named_parameters(), b.named_parameters(), before.named_parameters()):
        torch.testing.assert_close(pa, pb, rtol=0, atol=0, msg=f"parameter {name} differs after resume")
        if not torch.equal(pa, p0):
            changed.add(name.split(".")[1])
    assert FAMILIES[family][1] <= changed  # every part trained
    ra, rb = read_metrics(tmp_path / "a"), read_metrics(tmp_path / "b")
    assert [r["step"] for r in rb] == [1, 2, 3, 4]
    for x, y in zip(ra, rb):
        for key in set(x) - {"step_time"} - {k for k in x if k.startswith("timing/")}:
            assert x[key] == pytest.approx(y[key], rel=1e-5, abs=1e-7), (x["step"], key)
    assert ra[0]["kl"] == 0.0 and ra[0]["sequence_kl"] == 0.0  # step 1: the policy is its reference


@pytest.mark.parametrize("family", FAMILY_PARAMS)
def test_lora_on_the_language_and_projection_layers(family, vlms, tmp_path):
    targets, _ = FAMILIES[family]
    trainer = train(vlms(family), tmp_path / "out", max_steps=2, save_steps=0, steps_per_generation=1,
                    num_iterations=1, use_peft=True, lora_r=4, lora_target_modules=targets,
                    save_merged_model=True)
    trained = {n for n, p in trainer.acc.unwrap_model(trainer.policy).named_parameters() if p.requires_grad}
    projector, language = {"llava": ("multi_modal_projector.linear_1", "language_model"),
                           "idefics3": ("connector.modality_projection.proj", "text_model")}.get(
        family, ("merger.mlp.0", "language_model"))
    assert any(f"{projector}.lora_A" in n for n in trained), sorted(trained)
    assert any(language in n and "q_proj.lora_A" in n for n in trained)
    assert read_metrics(tmp_path / "out")[1]["kl"] != 0.0  # the adapters moved the policy off its reference
    merged = AutoModelForImageTextToText.from_pretrained(tmp_path / "out" / "final-merged")
    assert merged.config.model_type == family


def test_images_for_a_text_only_model_are_refused_before_any_model_loads(tmp_path):
    from rloo_engine.testing.tiny_models import build_causal_lm, train_tokenizer

    text_model = build_causal_lm(tmp_path / "lm", train_tokenizer())
    with pytest.raises(ConfigError, match=r"train_dataset: column 'image' holds images, and .* is a text-only model"):
        RLOOTrainer(model=str(text_model), reward_funcs=picture_number, args=args(tmp_path / "out"),
                    train_dataset=picture_rows())


def test_a_prompt_with_an_image_is_never_cut(llava, tmp_path):
    with pytest.raises(ConfigError, match="max_prompt_length: 8 tokens, and prompt .* image"):
        train(llava, tmp_path / "out", max_prompt_length=8, max_steps=1, save_steps=0)


def test_the_readme_vlm_example_runs(llava, tmp_path, monkeypatch):
    """README's block as written (readme-vlm-example), with the hub id swapped for the tiny LLaVA and fewer steps; its
    reward reads each row's image file, decoded by the datasets.Image column."""
    from tests.doc_blocks import REPO, blocks

    (block,) = [b for b in blocks(REPO / "README.md")
                if b.kind == "covered" and "tests/engine/test_vision_language.py:readme-vlm-example" in b.argument]
    code = block.text
    assert '"llava-hf/llava-1.5-7b-hf"' in code and "max_steps=200, save_steps=50" in code
    code = code.replace('"llava-hf/llava-1.5-7b-hf"', repr(str(llava))).replace(
        "max_steps=200, save_steps=50", "max_steps=2, save_steps=0, per_device_train_batch_size=8, "
        "num_generations=4, max_completion_length=6, report_to=[]")
    monkeypatch.chdir(tmp_path)
    with open("pictures.jsonl", "w") as rows:
        for k in range(4):
            image(k).save(f"picture{k}.png")
            rows.write(json.dumps({"prompt": [{"role": "user", "content": "Which half is brighter?"}],
                                   "image": f"picture{k}.png"}) + "\n")
    exec(compile(code, "README.md", "exec"), {"__name__": "readme"})
    rows = read_metrics(tmp_path / "llava-RLOO")
    assert rows[-1]["step"] == 2 and "rewards/names_the_brighter_half/mean" in rows[-1]
    assert AutoModelForImageTextToText.from_pretrained(tmp_path / "llava-RLOO" / "final").config.model_type == "llava"


@pytest.mark.parametrize("family", FAMILY_PARAMS)
def test_the_forward_sees_each_token_as_generation_did_with_left_padding(family, vlms, tmp_path):
    """The log-prob passes must compute what `generate` computed when it drew each token, rows of different prompt
    lengths left-padded: the same positions (Qwen: its rotary index from the images) and pixel inputs. Compared on
    generate's raw logits (before any processor), so the image-token suppression does not enter."""
    from rloo_engine.logprobs import batched_token_logps

    rows = datasets.Dataset.from_list([{"prompt": [{"role": "user", "content": f"picture {k} " + "the cat sat " * k}],
                                        "image": image(k, SIDE)} for k in range(8)])
    trainer = RLOOTrainer(model=str(vlms(family)), reward_funcs=picture_number, train_dataset=rows,
                          args=args(tmp_path / "out", per_device_train_batch_size=16, steps_per_generation=1,
                                    num_iterations=1, max_steps=1))
    draw = trainer.feed.take(lambda: 0)
    policy = trainer.acc.unwrap_model(trainer.policy).eval()
    ids, mask, vision = encode_prompts(trainer.processor, draw.rendered, draw.images, None,
                                       numbers_own_positions(policy))
    assert len(set(mask.sum(1).tolist())) == 4  # four prompt lengths, left-padded
    out = policy.generate(input_ids=ids, attention_mask=mask, **vision.model_kwargs(ids.size(1)), do_sample=True,
                          max_new_tokens=6, min_new_tokens=6, output_logits=True, return_dict_in_generate=True,
                          pad_token_id=trainer.tokenizer.pad_token_id)
    completion = out.sequences[:, ids.size(1):]
    raw = torch.stack(out.logits, 1).log_softmax(-1).gather(-1, completion.unsqueeze(-1)).squeeze(-1)
    forward = batched_token_logps(policy, out.sequences, torch.cat([mask, torch.ones_like(completion)], 1),
                                  ids.size(1), 1.0, 4, vision=vision)
    assert (forward - raw).abs().max() < 1e-5


def test_a_sampled_image_token_is_suppressed_as_trl_does(llava, tmp_path, capfd):
    """A token that stands for an image's features, sampled in a completion, has no features: the next forward of
    that row failed ("Image features and image tokens do not match"). Generation suppresses it, so pi_old comes
    from a forward pass (sampling_logprobs auto; 'generation' is refused by name)."""
    image_token = AutoProcessor.from_pretrained(llava).tokenizer.convert_tokens_to_ids("<image>")
    favour = {"generation_kwargs": {"sequence_bias": [[[image_token], 50.0]]}}  # sampled nearly always, unsuppressed
    trainer = train(llava, tmp_path / "out", max_steps=1, save_steps=0, steps_per_generation=1, num_iterations=1,
                    sampling_logprobs="auto", **favour)
    assert "image tokens are suppressed while sampling" in capfd.readouterr().err
    completions = trainer.batch.input_ids[:, trainer.batch.prompt_length:]
    assert not (completions == image_token).any()
    with pytest.raises(ConfigError, match=r"sampling_logprobs: 'generation' with logits processors .*suppress_tokens "
                                          r"\(a vision-language model's image tokens\)"):
        train(llava, tmp_path / "gen", max_steps=1, save_steps=0, sampling_logprobs="generation")


@pytest.mark.parametrize("log_multimodal", [True, False])
def test_logged_completions_carry_their_prompt_images_to_files_and_mlflow(llava, tmp_path, monkeypatch,
                                                                           log_multimodal):
    import mlflow

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    mlflow.MlflowClient(uri).create_experiment("vlm", artifact_location=str(tmp_path / "artifacts"))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "vlm")
    monkeypatch.setenv("MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING", "false")
    out = tmp_path / "out"
    train(llava, out, max_steps=2, save_steps=0, steps_per_generation=1, num_iterations=1, report_to=["mlflow"],
          log_completions=True,
          log_multimodal=log_multimodal)
    rows = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1] * 4 + [2] * 4  # per_device_train_batch_size 4: one prompt a step
    client = mlflow.MlflowClient(uri)
    run_id = json.loads((out / "mlflow_run.json").read_text())["run_id"]
    table = json.loads(Path(client.download_artifacts(run_id, "completions.json", str(tmp_path))).read_text())
    if not log_multimodal:
        assert "images" not in rows[0] and not (out / "completion_images").exists() and "image" not in table["columns"]
        return
    for row in rows:  # the prompt's own picture, saved once for its G completions
        (name,) = row["images"]
        assert name == f"completion_images/step-{row['step']}/prompt-0-0.png"
        k = int(re.search(r"picture (\d+)", row["prompt"]).group(1))
        with PIL.Image.open(out / name) as saved:
            assert numpy.array_equal(numpy.asarray(saved), numpy.asarray(image(k, SIDE)))
    uploaded = {a.path for a in client.list_artifacts(run_id, "completion_images/step-1")}
    assert uploaded == {"completion_images/step-1/prompt-0-0.png"}
    cells = [row[table["columns"].index("image")] for row in table["data"]]
    assert len(cells) == 8 and all(cell["type"] == "image" for cell in cells)


def test_a_prompt_without_images_is_cut_from_the_left_as_text_prompts_are(llava):
    """In a batch of a VLM, a prompt with no image over max_prompt_length keeps its last tokens (its per-token fields
    too); one with an image is refused, naming the option and the prompt."""
    processor = AutoProcessor.from_pretrained(llava)
    text = "the cat sat on the mat " * 6
    whole, _, _ = encode_prompts(processor, [text], [[]], None, False)
    ids, mask, vision = encode_prompts(processor, [text, "<image>a"], [[], [image(0, SIDE)]], 12, False)
    assert ids[0].tolist() == whole[0, -12:].tolist() and mask[0].sum() == 12
    assert vision.counts["pixel_values"].tolist() == [0, 1]
    with pytest.raises(ConfigError, match=r"generation.max_prompt_length: 3 tokens, and prompt p1 with its 1 image"):
        encode_prompts(processor, ["a", "<image>a"], [[], [image(0, SIDE)]], 3, False,
                       field="generation.max_prompt_length", names=["p0", "p1"])
