"""What the colocate and server tests check of a vision-language model's rollout from vLLM: the trainer's forward
of the synced weights, with each row's own pixel inputs, gives the log-prob vLLM reported for every sampled token,
renormalised without the image token that sampling suppresses (as TRL does): log p(t) - log(1 - p(<image>))."""

from __future__ import annotations

from pathlib import Path

import torch

from rloo_engine.data import render_prompt
from rloo_engine.testing.tiny_vlm import image

LOGPROB_TOLERANCE = 1e-5  # |vLLM - trainer| per token, fp32 on CPU (as the text models')


def picture_prompts(processor, num_images: int) -> tuple[list[str], list[list]]:
    """`num_images` prompts, each with an image of its own and the same words (so only the image tells the rows
    apart), and one more prompt without an image."""
    with_image = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what is this picture"}]}]
    without = [{"role": "user", "content": "no picture here"}]
    texts = [render_prompt(processor, with_image)] * num_images + [render_prompt(processor, without)]
    return texts, [[image(k, 56)] for k in range(num_images)] + [[]]


def moved(path: Path, seed: int = 1):
    """The model at `path` with every weight moved (vision tower and connector too): a trainer's step, as far as
    vLLM can tell."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(path).eval()
    with torch.no_grad():
        noise = torch.Generator().manual_seed(seed)
        for p in model.parameters():
            p.add_(0.05 * p.abs().mean() * torch.randn(p.shape, generator=noise))
    return model


def largest_logprob_gap(model, rollout, image_token: int) -> float:
    """max |vLLM's log-prob - the trainer's, renormalised without `image_token`| over the sampled tokens; asserts
    first that no image token was sampled."""
    ids = torch.cat([rollout.prompt_ids, rollout.completion_ids], 1)
    mask = torch.cat([rollout.prompt_mask, rollout.completion_mask], 1)
    P = rollout.prompt_ids.size(1)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                       **rollout.vision.model_kwargs(ids.size(1))).logits
    logps = logits[:, P - 1:-1].float().log_softmax(-1)
    expected = (logps.gather(-1, rollout.completion_ids.unsqueeze(-1)).squeeze(-1)
                - torch.log1p(-logps[..., image_token].exp()))
    done = rollout.completion_mask.bool()
    assert not (rollout.completion_ids[done] == image_token).any()
    return (expected - rollout.generator_logps).abs()[done].max().item()
