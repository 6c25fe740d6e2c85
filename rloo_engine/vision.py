"""Prompts with images (vision-language models, as TRL's RLOOTrainer trains them). torch is imported where it is
used, so reading a dataset's images (the evaluation's prompt loading) never pays for it.

A dataset row holds a conversational `prompt` and `image` (one) or `images` (a list): PIL images, paths, or the
`{"bytes", "path"}` dicts `datasets.Image` stores. The prompt's first user message gets one `{"type": "image"}`
item per image (TRL's `prepare_multimodal_messages`), the chat template writes the model's image placeholder, and
the model's processor turns text and images into token ids and pixel inputs.

Each prompt is processed on its own, so every row keeps exactly its own pixel inputs (`VisionRows`) through
generation, the log-prob passes and the loss's micro-batches, whatever the family's layout of them (LLaVA: one
(3, H, W) image per entry; Qwen2-VL: one patch per entry, with `image_grid_thw` per image).
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rloo_engine.config_base import ConfigError

if TYPE_CHECKING:
    import torch

IMAGE_COLUMNS = ("image", "images")
_TOKEN_LEVEL = ("token_type_ids", "mm_token_type_ids")  # per prompt token, like input_ids


def has_images(row: dict) -> bool:
    return any(row.get(column) is not None for column in IMAGE_COLUMNS)


def image_items(row: dict) -> list:
    """The row's images as the dataset holds them: `images` (a list), else `image` (one); [] when it has none."""
    value = row.get("images") if row.get("images") is not None else row.get("image")
    return [] if value is None else list(value) if isinstance(value, (list, tuple)) else [value]


def row_images(row: dict, where: str = "dataset") -> list:
    """The row's images as PIL images (`images` a list, or `image` one); [] when it has none."""
    from PIL import Image

    images = []
    for item in image_items(row):
        if isinstance(item, dict):  # datasets.Image(decode=False): {"bytes": ..., "path": ...}
            item = io.BytesIO(item["bytes"]) if item.get("bytes") else item.get("path")
        if isinstance(item, (str, Path, io.BytesIO)):
            try:
                item = Image.open(item)
            except (OSError, ValueError) as err:
                raise ConfigError(f"{where}: cannot open image {str(item)[:80]!r}: {err}") from None
        if not isinstance(item, Image.Image):
            raise ConfigError(f"{where}: image of type {type(item).__name__}; expected a PIL image, a path or the "
                              "{'bytes', 'path'} dict datasets.Image stores")
        images.append(item.convert("RGB"))
    return images


def with_image_items(prompt: list[dict], count: int) -> list[dict]:
    """`prompt` with `count` image items before the text of its first user message (TRL's
    `prepare_multimodal_messages`); a prompt whose messages already hold image items is left as it is."""
    def is_image(part: Any) -> bool:
        return isinstance(part, dict) and part.get("type") == "image"

    if any(isinstance(m["content"], list) and any(is_image(p) for p in m["content"]) for m in prompt):
        return prompt
    out, placed = [], False
    for message in prompt:
        if message["role"] == "user" and not placed and isinstance(message["content"], str):
            message = {**message, "content": [*({"type": "image"} for _ in range(count)),
                                              {"type": "text", "text": message["content"]}]}
            placed = True
        out.append(message)
    return out


@dataclass
class VisionRows:
    """The pixel inputs of N rows. `fields`: name -> tensor whose dim 0 concatenates the rows' entries in row order
    (images, or patches), `counts[name]`: (N,) entries per row. `token_fields`: name -> (N, P) per prompt token,
    left-padded with 0 as the prompt ids are. `own_positions`: the model numbers positions itself (Qwen2-VL's
    multimodal rotary index), so no 1-D position_ids are passed."""

    fields: dict[str, torch.Tensor]
    counts: dict[str, torch.Tensor]
    token_fields: dict[str, torch.Tensor]
    own_positions: bool = False

    def rows(self, rows: slice) -> VisionRows:
        fields = {}
        for name, tensor in self.fields.items():
            ends = self.counts[name].cumsum(0)
            starts = ends - self.counts[name]
            picked = range(*rows.indices(len(ends)))
            first, last = (int(starts[picked[0]]), int(ends[picked[-1]])) if picked else (0, 0)
            fields[name] = tensor[first:last]
        return VisionRows(fields, {k: v[rows] for k, v in self.counts.items()},
                          {k: v[rows] for k, v in self.token_fields.items()}, self.own_positions)

    def repeat(self, times: int) -> VisionRows:
        """Each row `times` times in a row (G completions of one prompt)."""
        import torch

        fields = {}
        for name, tensor in self.fields.items():
            parts = tensor.split(self.counts[name].tolist())
            fields[name] = torch.cat([p for p in parts for _ in range(times)])
        return VisionRows(fields, {k: v.repeat_interleave(times) for k, v in self.counts.items()},
                          {k: v.repeat_interleave(times, 0) for k, v in self.token_fields.items()}, self.own_positions)

    def model_kwargs(self, length: int) -> dict[str, torch.Tensor]:
        """The model's keyword inputs for these rows over `length` tokens (prompt, then completion: token-level
        fields are 0 after the prompt)."""
        import torch

        out = dict(self.fields)
        for name, tensor in self.token_fields.items():
            out[name] = torch.nn.functional.pad(tensor, (0, length - tensor.size(1)))
        return out

    def to(self, device: torch.device | str) -> VisionRows:
        move = lambda d: {k: v.to(device) for k, v in d.items()}  # noqa: E731
        return VisionRows(move(self.fields), move(self.counts), move(self.token_fields), self.own_positions)

    def state_dict(self) -> dict[str, Any]:
        return {"fields": self.fields, "counts": self.counts, "token_fields": self.token_fields,
                "own_positions": self.own_positions}


def placeholder_token_ids(config: Any) -> list[int]:
    """The ids that stand for an image's (or a video's) features in a prompt. Generation suppresses them, as TRL
    does: a sampled one would have no features to match, and the next forward of the row fails."""
    ids = [getattr(config, name, None) for name in ("image_token_id", "video_token_id")]
    return [i for i in ids if isinstance(i, int)]


def suppressing_placeholders(generation_kwargs: dict, config: Any) -> dict:
    """`generate`'s keyword arguments with the placeholder ids added to any `suppress_tokens` they hold."""
    suppressed = {*(generation_kwargs.get("suppress_tokens") or ()), *placeholder_token_ids(config)}
    return {**generation_kwargs, "suppress_tokens": sorted(suppressed)}


def numbers_own_positions(model: torch.nn.Module) -> bool:
    """Whether the model computes its positions from the images (a multimodal rotary index, Qwen2-VL's
    `get_rope_index`): 1-D position_ids would then be wrong."""
    return any(hasattr(m, "get_rope_index") for m in model.modules())


def encode_prompts(processor: Any, texts: list[str], images: list[list], max_length: int | None,
                   own_positions: bool, add_special_tokens: bool = False, field: str = "max_prompt_length",
                   names: list[str] | None = None) -> tuple[torch.Tensor, torch.Tensor, VisionRows]:
    """Left-padded prompt ids and mask (K, P) and the K prompts' pixel inputs, each prompt processed with its own
    images. Over `max_length` tokens, a prompt without images keeps its last ones, as text prompts do; one with
    images is refused (cutting it could cut an image's placeholder tokens), naming `field` and the prompt (`names`,
    else its place in the batch)."""
    import torch

    ids, outputs = [], []
    for k, (text, prompt_images) in enumerate(zip(texts, images, strict=True)):
        enc = processor(text=[text], images=prompt_images or None, return_tensors="pt",
                        add_special_tokens=add_special_tokens)
        row, keep = enc["input_ids"][0], slice(None)
        if max_length is not None and row.numel() > max_length:
            if prompt_images:
                name = names[k] if names else f"{k} of this batch"
                raise ConfigError(f"{field}: {max_length} tokens, and prompt {name} with its {len(prompt_images)} "
                                  f"image(s) is {row.numel()}; prompts with images are not cut (an image's tokens "
                                  f"must stay whole): raise {field} or shorten the prompt")
            keep = slice(-max_length, None)
        ids.append(row[keep])
        outputs.append({name: value[:, keep] if name in _TOKEN_LEVEL else value for name, value in enc.items()
                        if isinstance(value, torch.Tensor) and name not in ("input_ids", "attention_mask")})
    width = max(r.numel() for r in ids)

    def left_pad(rows: list[torch.Tensor], value: int) -> torch.Tensor:
        return torch.stack([torch.nn.functional.pad(r, (width - r.numel(), 0), value=value) for r in rows])

    names = dict.fromkeys(name for out in outputs for name in out)
    fields, counts, token_fields = {}, {}, {}
    for name in names:
        if name in _TOKEN_LEVEL:
            token_fields[name] = left_pad([out[name][0] if name in out else torch.zeros_like(r)
                                           for out, r in zip(outputs, ids)], 0)
        else:  # a prompt without images has no entries
            fields[name] = torch.cat([out[name] for out in outputs if name in out])
            counts[name] = torch.tensor([out[name].size(0) if name in out else 0 for out in outputs])
    prompt_ids = left_pad(ids, processor.tokenizer.pad_token_id)
    prompt_mask = left_pad([torch.ones_like(r) for r in ids], 0)
    return prompt_ids, prompt_mask, VisionRows(fields, counts, token_fields, own_positions)


def is_vision_language(config: Any) -> bool:
    """A config that `AutoModelForImageTextToText` maps (TRL's test for a VLM)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    return config.model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES


def vision_processor(processing_class: Any, cfg: Any, given: torch.nn.Module | None, dataset: Any,
                     say=lambda message: None) -> Any | None:
    """The processor of a vision-language policy: `processing_class` when it is one, else the checkpoint's
    `AutoProcessor`; None for a text-only model. Refused here, before any model loads: a dataset with images for a
    text-only model."""
    from transformers import AutoConfig, AutoProcessor

    from rloo_engine.models import hub_kwargs

    path = cfg.model_name_or_path
    try:
        config = given.config if given is not None else AutoConfig.from_pretrained(path, **hub_kwargs(cfg))
    except (OSError, ValueError):
        return None  # the model's own load says what is wrong with it
    columns = [c for c in IMAGE_COLUMNS if c in (getattr(dataset, "column_names", None) or [])]
    if not is_vision_language(config):
        if columns:
            raise ConfigError(f"train_dataset: column {columns[0]!r} holds images, and {path!r} is a text-only model "
                              f"(model_type {config.model_type!r}); images need a vision-language model, one that "
                              "AutoModelForImageTextToText loads (Qwen2-VL, LLaVA, Gemma 3, ...)")
        return None
    say(f"rloo-engine: {config.model_type} is a vision-language model: without vLLM its prompts generate with HF "
        "generate on G copies of each prompt, and every row's prompt runs whole in the log-prob passes (the shared "
        "prefill, fused_decode and share_prompt_forward split a text decoder's cache, not a vision tower's inputs); "
        "its image tokens are suppressed while sampling, as TRL does, so pi_old comes from a forward pass")
    if hasattr(processing_class, "image_processor"):
        return processing_class
    try:
        return AutoProcessor.from_pretrained(path, **hub_kwargs(cfg))
    except (OSError, ValueError, TypeError) as err:
        raise ConfigError(f"processing_class: {path!r} is a vision-language model ({config.model_type}) and its "
                          f"processor does not load: {err}; pass processing_class=AutoProcessor.from_pretrained(...)"
                          ) from None
