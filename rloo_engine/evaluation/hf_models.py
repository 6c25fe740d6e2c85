"""Loading local causal LMs and vision-language models for generation and the hf judge, and fingerprinting model
weights.

torch and transformers are imported inside the functions, so an evaluation that only reads
completion files and calls an HTTP judge never pays for importing them.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from rloo_engine.config_base import ConfigError

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".json", ".model", ".txt")


def resolve_device(name: str) -> str:
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return name


def resolve_dtype(name: str) -> Any:
    import torch

    return "auto" if name == "auto" else getattr(torch, name)


def load_causal_lm(path: str, dtype: str, device: str, field: str) -> tuple[Any, Any]:
    """(model, tokenizer) of a causal LM, in eval mode on `device`. Errors name `field`, the option `path` came from."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=resolve_dtype(dtype))
    except (OSError, ValueError) as err:
        raise ConfigError(f"{field}: cannot load {path!r} as a causal LM: {err}") from None
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.to(resolve_device(device)).eval()
    return model, tokenizer


def model_config(path: str) -> Any | None:
    """The model's `AutoConfig`; None when it does not load (the model's own load then says what is wrong)."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(path)
    except (OSError, ValueError, KeyError):
        return None


def is_vision_language_model(path: str) -> bool:
    """Whether `path` is a model `AutoModelForImageTextToText` loads (LLaVA, Qwen2-VL, ...)."""
    from rloo_engine.vision import is_vision_language

    config = model_config(path)
    return config is not None and is_vision_language(config)


def load_vision_language_model(path: str, dtype: str, device: str, field: str) -> tuple[Any, Any]:
    """(model, processor) of a vision-language model, in eval mode on `device`; errors name `field`."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    try:
        processor = AutoProcessor.from_pretrained(path)
        model = AutoModelForImageTextToText.from_pretrained(path, dtype=resolve_dtype(dtype))
    except (OSError, ValueError, TypeError) as err:
        raise ConfigError(
            f"{field}: cannot load {path!r} as a vision-language model (AutoModelForImageTextToText and its "
            f"AutoProcessor): {err}"
        ) from None
    if processor.tokenizer.pad_token is None:
        processor.tokenizer.pad_token = processor.tokenizer.eos_token
    model.to(resolve_device(device)).eval()
    return model, processor


def weights_fingerprint(path: str) -> str:
    """A short hash of a local model directory's file names, sizes and modification times (hub ids: the id).

    Cheap enough to compute on every run, and it changes when a checkpoint is overwritten in place,
    so stale generations or cached judgments of an older model are not reused.
    """
    p = Path(path)
    if not p.is_dir():
        return hashlib.sha256(path.encode()).hexdigest()[:16]
    digest = hashlib.sha256()
    for f in sorted(p.iterdir()):
        if f.is_file() and f.suffix in _WEIGHT_SUFFIXES:
            st = f.stat()
            digest.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns};".encode())
    return digest.hexdigest()[:16]
