"""Tiny offline vision-language models shaped like the ones TRL's RLOOTrainer trains (issue 49): random weights, a
BPE tokenizer trained on local text with the family's image token, the family's processor built locally (no
download) and a chat template that places an image where a message's content says `{"type": "image"}`.

- `llava`: LLaVA-1.5's layout (`LlavaForConditionalGeneration`): a CLIP vision tower, a two-layer projector and a
  Llama decoder. A 28 x 28 image is 2 x 2 patches of 14, so the processor writes `<image>` 4 times (CLIP's class
  token is dropped: `vision_feature_select_strategy` "default"). Its processor needs no torchvision, so it runs in
  the engine's own install.

`image(seed)` draws a small RGB test image.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from PIL import Image

from rloo_engine.testing.tiny_models import train_tokenizer

IMAGE_TOKEN = "<image>"
# The tiny chat template (tiny_models.CHAT_TEMPLATE), with list contents: text items, and image items as <image>.
VLM_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<image>{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}"
    "{% endfor %}{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
FAMILIES = ("llava",)
IMAGE_SIDE = 28  # pixels: 2 x 2 patches of 14


def image(seed: int = 0, side: int = IMAGE_SIDE) -> Image.Image:
    """A random RGB image, `side` x `side`."""
    pixels = np.random.default_rng(seed).integers(0, 256, (side, side, 3), dtype=np.uint8)
    return Image.fromarray(pixels, "RGB")


def build_vlm(out_dir: str | Path, family: str = "llava", hidden: int = 64, layers: int = 2, seed: int = 0) -> Path:
    """Saves a random-init `family` VLM with its processor (tokenizer, image processor, chat template) to `out_dir`;
    it loads with `AutoModelForImageTextToText` and `AutoProcessor`. Attention heads of 32 dimensions (vLLM's CPU
    attention needs at least 32)."""
    from transformers import AutoModelForImageTextToText, CLIPImageProcessorPil, LlavaConfig, LlavaProcessor

    if family not in FAMILIES:
        raise ValueError(f"family: {family!r}; expected one of {', '.join(FAMILIES)}")
    tok = train_tokenizer(chat_template=VLM_CHAT_TEMPLATE, extra_specials=(IMAGE_TOKEN,))
    heads = hidden // 32
    text = dict(model_type="llama", vocab_size=len(tok), hidden_size=hidden, intermediate_size=hidden * 2,
                num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                max_position_embeddings=512, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                bos_token_id=tok.eos_token_id, tie_word_embeddings=True)
    vision = dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=1, image_size=IMAGE_SIDE, patch_size=14, projection_dim=32)
    config = LlavaConfig(text_config=text, vision_config=vision, image_token_id=tok.convert_tokens_to_ids(IMAGE_TOKEN),
                         vision_feature_layer=-1, vision_feature_select_strategy="default",
                         tie_word_embeddings=True)
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    side = {"height": IMAGE_SIDE, "width": IMAGE_SIDE}
    processor = LlavaProcessor(
        image_processor=CLIPImageProcessorPil(size={"shortest_edge": IMAGE_SIDE}, crop_size=side),
        tokenizer=tok, patch_size=14, vision_feature_select_strategy="default", image_token=IMAGE_TOKEN,
        num_additional_image_tokens=1, chat_template=VLM_CHAT_TEMPLATE)
    out = Path(out_dir)
    model.save_pretrained(out)
    processor.save_pretrained(out)
    return out
