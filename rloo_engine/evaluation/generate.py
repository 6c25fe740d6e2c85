"""Completion generation for the eval prompts with HF `generate` (batched, left-padded, greedy by default) or,
with `generation.backend: vllm`, offline vLLM on the same prompt tokens (`generate_vllm.py`).

Prompts are sorted by token length before batching (less padding), and the completions are saved
as JSONL keyed by prompt id next to a `.meta.json` fingerprint (model weights, generation options,
prompt ids, and the image files when prompts have images). A rerun with the same fingerprint reuses
the file instead of generating again, so an interrupted evaluation resumes with the very same
completions, and so the same judge cache keys. A vision-language model generates each prompt with
its images (`generate_images.py`); prompts with images on vLLM or a text-only model are refused.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

from rloo_engine.config_base import ConfigError
from rloo_engine.evaluation.config import EvalGenerationConfig
from rloo_engine.evaluation.data import EvalPrompt, load_completions, save_completions
from rloo_engine.evaluation.hf_models import (
    is_vision_language_model,
    load_causal_lm,
    load_vision_language_model,
    model_config,
    weights_fingerprint,
)
from rloo_engine.evaluation.images import images_fingerprint
from rloo_engine.progress import progress_bar

log = logging.getLogger(__name__)


def render_prompt(tokenizer: Any, prompt: str | list[dict[str, Any]], chat_template: bool) -> tuple[str, bool]:
    """(text to tokenize, whether it came from the chat template and so already holds special tokens).

    Rendering is the training engine's (`rloo_engine.data.render_prompt`), so the policy sees eval
    prompts exactly as it saw training prompts.
    """
    from rloo_engine.data import DataError
    from rloo_engine.data import render_prompt as engine_render_prompt

    if isinstance(prompt, str) and not chat_template:
        return prompt, False
    messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    try:
        return engine_render_prompt(tokenizer, messages), True
    except DataError as err:
        raise ConfigError(f"generation.chat_template: {err}") from None


def encode_prompts(tok: Any, prompts: list[EvalPrompt], gen: EvalGenerationConfig) -> list[list[int]]:
    """Each prompt's token ids as the model continues them: rendered, then cut to `max_prompt_length` from the left."""
    encoded = []
    for ep in prompts:
        text, templated = render_prompt(tok, ep.prompt, gen.chat_template)
        ids = tok(text, add_special_tokens=not templated)["input_ids"]
        encoded.append(ids[-gen.max_prompt_length :] if gen.max_prompt_length else ids)
    return encoded


def generate_completions(
    model_path: str, prompts: list[EvalPrompt], gen: EvalGenerationConfig, *, field: str, progress: bool = True
) -> dict[str, str]:
    """{prompt_id: completion} for every prompt; `field` names the config option `model_path` came from."""
    check_images_fit(model_path, prompts, gen, field)
    if gen.backend == "vllm":
        from rloo_engine.evaluation.generate_vllm import generate_completions_vllm, load_tokenizer

        tok = load_tokenizer(model_path, field)
        texts = generate_completions_vllm(model_path, tok, encode_prompts(tok, prompts, gen), gen, progress=progress)
        return {ep.prompt_id: text for ep, text in zip(prompts, texts, strict=True)}
    if is_vision_language_model(model_path):
        return _generate_with_images(model_path, prompts, gen, field, progress)
    import torch
    from transformers import set_seed

    model, tok = load_causal_lm(model_path, gen.dtype, gen.device, field)
    tok.padding_side = "left"
    tok.truncation_side = "left"
    encoded = encode_prompts(tok, prompts, gen)
    order = sorted(range(len(prompts)), key=lambda i: len(encoded[i]))
    sampling = sampling_kwargs(gen)
    set_seed(gen.seed)
    device = next(model.parameters()).device
    completions: dict[str, str] = {}
    bar = progress_bar(total=len(prompts), desc=f"generating {Path(model_path).name}", unit="prompt", disable=not progress)
    try:
        for start in range(0, len(order), gen.batch_size):
            batch = order[start : start + gen.batch_size]
            batch_ids = [encoded[i] for i in batch]
            width = max(len(ids) for ids in batch_ids)
            input_ids = torch.tensor(
                [[tok.pad_token_id] * (width - len(ids)) + ids for ids in batch_ids], device=device
            )
            attention_mask = torch.tensor(
                [[0] * (width - len(ids)) + [1] * len(ids) for ids in batch_ids], device=device
            )
            with torch.no_grad():
                out = model.generate(
                    input_ids=input_ids,
                    attention_mask=attention_mask,
                    max_new_tokens=gen.max_new_tokens,
                    pad_token_id=tok.pad_token_id,
                    **sampling,
                    **gen.generation_kwargs,
                )
            texts = tok.batch_decode(out[:, width:], skip_special_tokens=True)
            for i, text in zip(batch, texts, strict=True):
                completions[prompts[i].prompt_id] = text
            bar.update(len(batch))
    finally:
        bar.close()
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return completions


def _generate_with_images(
    model_path: str, prompts: list[EvalPrompt], gen: EvalGenerationConfig, field: str, progress: bool
) -> dict[str, str]:
    """A vision-language model's completions (`generate_images.py`), each prompt with its images."""
    import torch

    from rloo_engine.evaluation.generate_images import generate_with_images

    model, processor = load_vision_language_model(model_path, gen.dtype, gen.device, field)
    rendered = [render_with_images(processor, ep, gen.chat_template) for ep in prompts]
    completions = generate_with_images(model, processor, prompts, rendered, gen, sampling_kwargs(gen),
                                       desc=f"generating {Path(model_path).name}", progress=progress)
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return completions


def render_with_images(processor: Any, ep: EvalPrompt, chat_template: bool) -> tuple[str, bool]:
    """(text to process, whether it came from the chat template) for a vision-language model. A prompt with images
    goes through the chat template (only the template writes the model's image placeholder), a string one as a user
    message, with one image item per image before the text of its first user message (`vision.with_image_items`;
    messages already holding image items are used as they are)."""
    from rloo_engine.vision import with_image_items

    if not ep.images:
        return render_prompt(processor, ep.prompt, chat_template)
    messages = ep.prompt if isinstance(ep.prompt, list) else [{"role": "user", "content": ep.prompt}]
    messages = with_image_items(messages, len(ep.images))
    placed = sum(
        1 for m in messages if isinstance(m["content"], list)
        for part in m["content"] if isinstance(part, dict) and part.get("type") == "image"
    )
    if placed != len(ep.images):
        raise ConfigError(
            f"prompts: prompt {ep.prompt_id} has {len(ep.images)} image(s) ({ep.images[0]}) and its messages place "
            f"{placed}; expected a user message with text content (the image items go before its text), or exactly "
            "one {'type': 'image'} item per image in its content"
        )
    return render_prompt(processor, messages, True)


def sampling_kwargs(gen: EvalGenerationConfig) -> dict[str, Any]:
    """`model.generate`'s decoding options: greedy, or sampling with the temperature and top_p."""
    sampling: dict[str, Any] = {"do_sample": gen.do_sample}
    if gen.do_sample:
        sampling.update(temperature=gen.temperature, top_p=gen.top_p)
    return sampling


def check_images_fit(model_path: str, prompts: list[EvalPrompt], gen: EvalGenerationConfig, field: str) -> None:
    """Eval prompts with images are refused before anything loads with `generation.backend: vllm` (not built) and
    for a text-only model; `field` names the option `model_path` came from."""
    with_images = [ep for ep in prompts if ep.images]
    if not with_images:
        return
    first = f"first: prompt {with_images[0].prompt_id} with {with_images[0].images[0]}"
    if gen.backend == "vllm":
        raise ConfigError(
            f"generation.backend: 'vllm', and {len(with_images)} eval prompts carry images ({first}); prompts with "
            "images generate with HF generate only for now: set generation.backend: hf"
        )
    config = model_config(model_path)
    if config is None:
        return  # its load says what is wrong
    from rloo_engine.vision import is_vision_language

    if not is_vision_language(config):
        raise ConfigError(
            f"{field}: {model_path!r} is a text-only model (model_type {config.model_type!r}), and "
            f"{len(with_images)} eval prompts carry images ({first}); images need a vision-language model, one "
            "AutoModelForImageTextToText loads (LLaVA, Qwen2-VL, ...), or a prompt set without image/images columns"
        )


def _fingerprint(model_path: str, prompts: list[EvalPrompt], gen: EvalGenerationConfig) -> dict[str, Any]:
    ids = hashlib.sha256(",".join(ep.prompt_id for ep in prompts).encode()).hexdigest()[:16]
    fingerprint = {
        "model": model_path,
        "weights": weights_fingerprint(model_path),
        "generation": gen.model_dump(),
        "prompts": ids,
    }
    references = [reference for ep in prompts for reference in ep.images]
    if references:  # prompts without images keep the fingerprint, so their completion files are still reused
        fingerprint["images"] = images_fingerprint(references)
    return fingerprint


def generate_or_reuse(
    model_path: str, prompts: list[EvalPrompt], gen: EvalGenerationConfig, out_path: Path, *, field: str, progress: bool
) -> dict[str, str]:
    """Completions from `out_path` if its fingerprint matches this model and these options; else generated and saved."""
    meta_path = out_path.with_name(out_path.stem + ".meta.json")
    fingerprint = _fingerprint(model_path, prompts, gen)
    if out_path.is_file() and meta_path.is_file():
        try:
            same = json.loads(meta_path.read_text(encoding="utf-8")) == fingerprint
        except json.JSONDecodeError:
            same = False
        if same:
            completions = load_completions(out_path)
            if all(ep.prompt_id in completions for ep in prompts):
                log.info("reusing %d completions of %s from %s", len(completions), model_path, out_path)
                return completions
    completions = generate_completions(model_path, prompts, gen, field=field, progress=progress)
    save_completions(out_path, prompts, completions)
    meta_path.write_text(json.dumps(fingerprint, indent=2), encoding="utf-8")
    return completions
