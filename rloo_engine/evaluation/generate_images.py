"""Eval completions of a vision-language model with HF `generate`: each prompt processed with its own images
(`vision.encode_prompts`, as the engine's HF generation backend does) and generated with its pixel inputs.

`generate.py` loads the model and processor and renders the prompts (`render_with_images`: a prompt with images
always goes through the chat template, which alone writes the model's image placeholder); this module batches,
processes and decodes. Kept as on the text path: greedy by default, `batch_size` prompts per call sorted by length,
left padding, the seed, `generation_kwargs`, completions decoded with special tokens dropped. What differs: a
prompt with images is never cut to `max_prompt_length` (a cut could split an image's tokens): it is refused,
naming the option. A prompt without images is cut from the left as on the text path.
"""

from __future__ import annotations

from typing import Any

from rloo_engine.evaluation.config import EvalGenerationConfig
from rloo_engine.evaluation.data import EvalPrompt
from rloo_engine.evaluation.images import open_images
from rloo_engine.progress import progress_bar


def generate_with_images(
    model: Any, processor: Any, prompts: list[EvalPrompt], rendered: list[tuple[str, bool]],
    gen: EvalGenerationConfig, sampling: dict[str, Any], *, desc: str, progress: bool = True,
) -> dict[str, str]:
    """{prompt_id: completion} for every prompt; `rendered`: each prompt's (text, whether it came from the chat
    template), `sampling`: `generate`'s decoding options."""
    import torch
    from transformers import set_seed

    from rloo_engine.vision import encode_prompts, numbers_own_positions, suppressing_placeholders

    tok = processor.tokenizer
    own_positions = numbers_own_positions(model)
    device = next(model.parameters()).device
    set_seed(gen.seed)
    completions: dict[str, str] = {}
    bar = progress_bar(total=len(prompts), desc=desc, unit="prompt", disable=not progress)
    try:
        for batch in prompt_batches(prompts, rendered, tok, gen.batch_size):
            batch_prompts = [prompts[i] for i in batch]
            templated = rendered[batch[0]][1]  # one per batch: the processor adds special tokens to all or none
            images = [open_images(ep.image_sources, f"prompts: prompt {ep.prompt_id}") for ep in batch_prompts]
            ids, mask, vision = encode_prompts(processor, [rendered[i][0] for i in batch], images,
                                               gen.max_prompt_length, own_positions, not templated,
                                               "generation.max_prompt_length", [ep.prompt_id for ep in batch_prompts])
            width = ids.size(1)
            # A sampled image token has no features to match (as in training and TRL): suppressed.
            generation_kwargs = suppressing_placeholders(gen.generation_kwargs, model.config)
            with torch.no_grad():
                out = model.generate(
                    input_ids=ids.to(device),
                    attention_mask=mask.to(device),
                    **vision.to(device).model_kwargs(width),
                    max_new_tokens=gen.max_new_tokens,
                    pad_token_id=tok.pad_token_id,
                    **sampling,
                    **generation_kwargs,
                )
            texts = tok.batch_decode(out[:, width:], skip_special_tokens=True)
            for ep, text in zip(batch_prompts, texts, strict=True):
                completions[ep.prompt_id] = text
            bar.update(len(batch))
    finally:
        bar.close()
    return completions


def prompt_batches(prompts: list[EvalPrompt], rendered: list[tuple[str, bool]], tok: Any, size: int) -> list[list[int]]:
    """Prompt indices in batches of at most `size`, sorted by (templated, images, text tokens) so that padding
    stays small; a batch never mixes templated and plain prompts."""
    text_tokens = [len(tok(text, add_special_tokens=False)["input_ids"]) for text, _ in rendered]
    order = sorted(range(len(prompts)), key=lambda i: (rendered[i][1], len(prompts[i].images), text_tokens[i]))
    batches: list[list[int]] = []
    for i in order:
        if not batches or len(batches[-1]) == size or rendered[batches[-1][0]][1] != rendered[i][1]:
            batches.append([])
        batches[-1].append(i)
    return batches
