"""Completion generation for the eval prompts with HF `generate` (batched, left-padded, greedy by default) or,
with `generation.backend: vllm`, offline vLLM on the same prompt tokens (`generate_vllm.py`).

Prompts are sorted by token length before batching (less padding), and the completions are saved
as JSONL keyed by prompt id next to a `.meta.json` fingerprint (model weights, generation options,
prompt ids). A rerun with the same fingerprint reuses the file instead of generating again, so an
interrupted evaluation resumes with the very same completions, and so the same judge cache keys.
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
from rloo_engine.evaluation.hf_models import load_causal_lm, weights_fingerprint
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
    if gen.backend == "vllm":
        from rloo_engine.evaluation.generate_vllm import generate_completions_vllm, load_tokenizer

        tok = load_tokenizer(model_path, field)
        texts = generate_completions_vllm(model_path, tok, encode_prompts(tok, prompts, gen), gen, progress=progress)
        return {ep.prompt_id: text for ep, text in zip(prompts, texts, strict=True)}
    import torch
    from transformers import set_seed

    model, tok = load_causal_lm(model_path, gen.dtype, gen.device, field)
    tok.padding_side = "left"
    tok.truncation_side = "left"
    encoded = encode_prompts(tok, prompts, gen)
    order = sorted(range(len(prompts)), key=lambda i: len(encoded[i]))
    sampling: dict[str, Any] = {"do_sample": gen.do_sample}
    if gen.do_sample:
        sampling.update(temperature=gen.temperature, top_p=gen.top_p)
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


def _fingerprint(model_path: str, prompts: list[EvalPrompt], gen: EvalGenerationConfig) -> dict[str, Any]:
    ids = hashlib.sha256(",".join(ep.prompt_id for ep in prompts).encode()).hexdigest()[:16]
    return {
        "model": model_path,
        "weights": weights_fingerprint(model_path),
        "generation": gen.model_dump(),
        "prompts": ids,
    }


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
