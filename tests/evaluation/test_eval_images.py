"""Eval prompts with images (issue 49): a tiny LLaVA policy and SFT model generate with each prompt's images, the
judge sees text only, and the image references are part of prompt ids, completion fingerprints and judge cache keys
(text-only prompts keep their ids and keys). Refused before any model loads: a missing or broken image (naming the
row), vLLM with images, a text-only model with images."""

from __future__ import annotations

import io
import json
import sqlite3
from contextlib import closing
from pathlib import Path

import PIL.Image
import pytest
import torch
from transformers import AutoModelForImageTextToText, AutoProcessor

from rloo_engine.config_base import ConfigError
from rloo_engine.data import render_prompt
from rloo_engine.evaluation import EvalConfig, EvalGenerationConfig, run_evaluation
from rloo_engine.evaluation import generate as generate_module
from rloo_engine.evaluation.cache import cache_key
from rloo_engine.evaluation.data import EvalPrompt, load_completions, load_prompts, prompt_id, prompt_text, read_jsonl
from rloo_engine.evaluation.generate import _fingerprint, generate_completions
from rloo_engine.evaluation.images import load_row_images
from rloo_engine.evaluation.judges.base import SlotPair
from rloo_engine.evaluation.preflight import check_inputs
from rloo_engine.testing.tiny_vlm import IMAGE_SIDE, build_vlm, image
from rloo_engine.vision import encode_prompts, with_image_items
from tests.evaluation.eval_helpers import write_jsonl

DESCRIBE = [{"role": "user", "content": "describe the picture"}]
# TRL's multimodal form: the image items already in the message (placed as they are)
COMPARE = [{"role": "user", "content": [{"type": "image"}, {"type": "image"},
                                        {"type": "text", "text": "which picture is brighter"}]}]
HELLO = [{"role": "user", "content": "say hello"}]
# A random-init decoder with tied embeddings repeats the last prompt token (a special one, dropped when decoded):
# suppressing the special tokens leaves completions that depend on the image.
GENERATION = {"max_new_tokens": 4, "generation_kwargs": {"suppress_tokens": list(range(7))}}
JUDGE = {"backend": "python", "function": "tests.evaluation.eval_helpers:prefer_longer"}


@pytest.fixture(scope="module")
def vlms(tmp_path_factory) -> tuple[Path, Path]:
    """(policy, SFT): the tiny LLaVA with two seeds."""
    root = tmp_path_factory.mktemp("vlms")
    return build_vlm(root / "policy", "llava", seed=1), build_vlm(root / "sft", "llava", seed=2)


def _eval_set(root: Path) -> Path:
    """Four prompts: one text twice over two images (black, white: the tiny models answer them differently), one
    with two images (its messages placing them), one without any."""
    (root / "images").mkdir(parents=True)
    PIL.Image.new("RGB", (IMAGE_SIDE, IMAGE_SIDE), (0, 0, 0)).save(root / "images" / "a.png")
    PIL.Image.new("RGB", (IMAGE_SIDE, IMAGE_SIDE), (255, 255, 255)).save(root / "images" / "b.png")
    image(3).save(root / "images" / "c.png")
    return write_jsonl(root / "prompts.jsonl", [
        {"prompt": DESCRIBE, "image": "images/a.png"},
        {"prompt": DESCRIBE, "image": "images/b.png"},
        {"prompt": COMPARE, "images": ["images/a.png", "images/c.png"]},
        {"prompt": HELLO},
    ])


def _config(prompts: Path, out: Path, **overrides) -> EvalConfig:
    values = {"prompts": str(prompts), "pairings": ["policy_vs_sft"], "generation": GENERATION, "judge": JUDGE,
              "output_dir": str(out), "progress": False}
    return EvalConfig.model_validate({**values, **overrides})


def _generate_alone(model_dir: Path, messages: list[dict], picture) -> str:
    """The completion of one prompt with its image, generated outside the evaluation."""
    processor = AutoProcessor.from_pretrained(model_dir)
    model = AutoModelForImageTextToText.from_pretrained(model_dir).eval()
    text = render_prompt(processor, with_image_items(messages, 1))
    ids, mask, vision = encode_prompts(processor, [text], [[picture]], None, False)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, **vision.model_kwargs(ids.size(1)), do_sample=False,
                             max_new_tokens=GENERATION["max_new_tokens"], pad_token_id=processor.tokenizer.pad_token_id,
                             **GENERATION["generation_kwargs"])
    return processor.tokenizer.decode(out[0, ids.size(1):], skip_special_tokens=True)


def test_an_evaluation_generates_with_each_prompts_images_and_keys_judgments_by_them(vlms, tmp_path, monkeypatch):
    policy, sft = vlms
    prompts_file = _eval_set(tmp_path / "data")
    prompts = load_prompts(str(prompts_file))
    on_a, on_b, two, plain = prompts
    picture_a, picture_b = (str((tmp_path / "data" / "images" / f"{n}.png").resolve()) for n in "ab")
    assert on_a.images == (picture_a,) and on_b.images == (picture_b,) and len(two.images) == 2
    assert on_a.prompt_id != on_b.prompt_id  # the same text over two images: two prompts
    assert plain.images == () and plain.prompt_id == prompt_id(HELLO)

    report = run_evaluation(_config(prompts_file, tmp_path / "out"), policy_path=policy, sft_path=sft)

    for side, model_dir in (("policy", policy), ("sft", sft)):
        rows = {r["prompt_id"]: r for r in read_jsonl(report.completions[side])}
        assert set(rows) == {ep.prompt_id for ep in prompts}
        assert rows[on_a.prompt_id]["images"] == [picture_a] and "images" not in rows[plain.prompt_id]
        assert load_completions(report.completions[side]) == {pid: r["completion"] for pid, r in rows.items()}
        # generated with the pixels: what the model says about each image on its own, and the images differ
        for ep, picture in ((on_a, picture_a), (on_b, picture_b)):
            assert rows[ep.prompt_id]["completion"] == _generate_alone(model_dir, DESCRIBE, PIL.Image.open(picture))
        assert rows[on_a.prompt_id]["completion"] != rows[on_b.prompt_id]["completion"]

    table = report.table()
    identity = report.judge["identity"]
    judged = {row["prompt_id"]: row for row in table if row["order"] is not None}
    assert set(judged) == {ep.prompt_id for ep in prompts}  # the two models answer every prompt differently
    for ep in (on_a, on_b, two, plain):
        row = judged[ep.prompt_id]
        shown = SlotPair(prompt_text(ep.prompt), row["completion_a"], row["completion_b"])
        order = shown if row["order"] == "ab" else SlotPair(shown.prompt, shown.answer_b, shown.answer_a)
        with_images = SlotPair(order.prompt, order.answer_a, order.answer_b, images=ep.images)
        assert row["cache_key"] == cache_key(identity, with_images)
        assert (row["cache_key"] == cache_key(identity, order)) == (not ep.images)
    with closing(sqlite3.connect(report.cache_path)) as db:
        rows = db.execute("SELECT key, prompt, images FROM judgments")
        stored = {key: (prompt, images) for key, prompt, images in rows}
    key_a = judged[on_a.prompt_id]["cache_key"]
    assert stored[key_a] == ("user: describe the picture", json.dumps([picture_a]))  # the judge was shown text only

    def must_not_run(*args, **kwargs):
        raise AssertionError("the completions of an unchanged model and prompt set are reused, not generated")

    monkeypatch.setattr(generate_module, "generate_completions", must_not_run)
    again = run_evaluation(_config(prompts_file, tmp_path / "out"), policy_path=policy, sft_path=sft)
    assert again.usage.judgments_made == 0 and again.usage.judgments_cached == report.usage.judgments_made


def test_keys_ids_and_fingerprints_of_prompts_without_images_are_unchanged(vlms, tmp_path):
    # Computed before images existed: caches and completion files of text-only evaluations keep their keys.
    identity = {"backend": "python", "function": "tests:rule", "source_hash": "abc"}
    pair = SlotPair("user: describe the picture", "a cat", "a dog")
    assert cache_key(identity, pair) == "61ba2385d5e5ebc904355f1b2ad3a97a5d6216a8e97cb8aeba55da0b3aed4d5d"
    assert cache_key(identity, SlotPair(pair.prompt, pair.answer_a, pair.answer_b, "gold")) == (
        "650b1fbdbe418a960af593b008d22b4eea5cad9e038061b7ba0cafbe8d9f9dbc")
    assert prompt_id(DESCRIBE) == prompt_id(DESCRIBE, ()) == "299e38192c6da9f6"
    assert prompt_id("describe the picture") == "e71e669a3d111393"
    assert cache_key(identity, SlotPair(pair.prompt, pair.answer_a, pair.answer_b, images=("/x.png",))) != (
        cache_key(identity, pair))

    # the judge is shown the text of messages that hold image items; other content lists as before
    with_item = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "describe the picture"}]}]
    assert prompt_text(with_item) == prompt_text(DESCRIBE) == "user: describe the picture"
    text_parts = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    assert prompt_text(text_parts) == "user: [{'type': 'text', 'text': 'hi'}]"

    prompts = load_prompts(str(_eval_set(tmp_path / "data")))
    gen = EvalGenerationConfig()
    assert "images" not in _fingerprint(str(vlms[0]), [prompts[3]], gen)  # the text-only prompt
    with_a, with_b = _fingerprint(str(vlms[0]), [prompts[0]], gen), _fingerprint(str(vlms[0]), [prompts[1]], gen)
    assert with_a["images"] != with_b["images"] and with_a["prompts"] != with_b["prompts"]


def test_a_missing_or_broken_image_is_refused_naming_the_row_before_any_model_loads(tmp_path):
    prompts_file = _eval_set(tmp_path / "data")
    rows = read_jsonl(prompts_file)
    missing = write_jsonl(tmp_path / "data" / "missing.jsonl", [rows[0], {"prompt": DESCRIBE, "image": "images/z.png"}])
    cfg = _config(missing, tmp_path / "out")
    with pytest.raises(ConfigError, match=r"missing.jsonl row 1: image 'images/z.png' is not a file \(.*z.png\)"):
        run_evaluation(cfg, policy_path=tmp_path / "no-model", sft_path=tmp_path / "no-model")
    (tmp_path / "data" / "images" / "broken.png").write_bytes(b"not a png")
    broken = write_jsonl(tmp_path / "data" / "broken.jsonl", [{"prompt": DESCRIBE, "images": ["images/broken.png"]}])
    with pytest.raises(ConfigError, match=r"broken.jsonl row 0: cannot open image '.*broken.png'"):
        load_prompts(str(broken))


def test_images_given_as_data_are_referenced_by_content_hash():
    picture = image(4)
    png = io.BytesIO()
    picture.save(png, format="PNG")
    as_pil = load_row_images({"image": picture}, None, "row 0")
    as_bytes = load_row_images({"images": [{"bytes": png.getvalue(), "path": None}, png]}, None, "row 1")
    assert as_pil.references[0].startswith("sha256:") and len(as_pil.references[0]) == len("sha256:") + 16
    assert as_bytes.references[0] == as_bytes.references[1] != as_pil.references[0]  # the PNG's bytes, not pixels
    assert load_row_images({"image": image(5)}, None, "row 2").references != as_pil.references


def test_vllm_with_images_and_a_text_only_model_with_images_are_refused(vlms, qwen2_model, tmp_path):
    prompts_file = _eval_set(tmp_path / "data")
    vllm = _config(prompts_file, tmp_path / "out", generation={**GENERATION, "backend": "vllm"},
                   policy_model_path=str(vlms[0]), sft_model_path=str(vlms[1]))
    with pytest.raises(ConfigError, match=r"generation.backend: 'vllm', and 3 eval prompts carry images"):
        check_inputs(vllm)  # the pipeline's check before training
    with pytest.raises(ConfigError, match=r"generation.backend: 'vllm', and 3 eval prompts carry images"):
        run_evaluation(vllm)
    assert not (tmp_path / "out" / "completions" / "policy.jsonl").exists()  # refused before generating
    with pytest.raises(ConfigError, match=r"sft_model_path: .* is a text-only model \(model_type 'qwen2'\)"):
        run_evaluation(_config(prompts_file, tmp_path / "out"), policy_path=vlms[0], sft_path=qwen2_model)
    assert not (tmp_path / "out" / "completions" / "policy.jsonl").exists()  # the SFT side refused first


def test_a_prompt_with_images_over_max_prompt_length_is_refused_naming_the_option(vlms, tmp_path):
    prompts = load_prompts(str(_eval_set(tmp_path / "data")))
    gen = EvalGenerationConfig(max_prompt_length=4, **GENERATION)
    with pytest.raises(ConfigError, match=r"generation.max_prompt_length: 4 tokens, and prompt \w+ with its 1 image"):
        generate_completions(str(vlms[0]), prompts[:1], gen, field="policy_model_path", progress=False)
    one_for_two = EvalPrompt(prompts[2].prompt_id, COMPARE, images=prompts[0].images,
                             image_sources=prompts[0].image_sources)
    with pytest.raises(ConfigError, match=r"has 1 image\(s\) .* and its messages place 2"):
        generate_completions(str(vlms[0]), [one_for_two], gen, field="policy_model_path", progress=False)
    # a prompt without images is cut from the left, as for a text-only model
    out = generate_completions(str(vlms[0]), prompts[3:], gen, field="policy_model_path", progress=False)
    assert list(out) == [prompts[3].prompt_id]
