"""Checks `rloo-engine train` makes before any model loads, so a bad option fails in seconds with its field named."""

from __future__ import annotations

from pathlib import Path

from rloo_engine.config import RLOOConfig
from rloo_engine.config_base import ConfigError


def check_before_loading(cfg: RLOOConfig) -> None:
    """Raises ConfigError for a reward function that does not import, an output_dir that is a file, or a
    reward model whose tokenizer makes ids its embedding does not have (an IndexError only after every model loaded)."""
    from rloo_engine.reward_sources import load_reward_function

    out = Path(cfg.output_dir)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"output_dir: {out} is a file; expected a directory (or a path that does not exist yet)")
    for path in cfg.reward_funcs:
        load_reward_function(path)
    if cfg.reward_model_name_or_path:
        check_tokenizer_fits_embedding("reward_model_name_or_path", cfg.reward_model_name_or_path)


def check_tokenizer_fits_embedding(field: str, path_or_id: str) -> None:
    """The model's tokenizer must not have more tokens than the model has embedding rows."""
    from transformers import AutoConfig, AutoTokenizer

    try:
        config = AutoConfig.from_pretrained(path_or_id)
        tokenizer = AutoTokenizer.from_pretrained(path_or_id)
    except Exception as err:
        raise ConfigError(f"{field}: {path_or_id} could not be loaded: {type(err).__name__}: {err}") from err
    rows = getattr(config.get_text_config(), "vocab_size", None)
    if rows is not None and len(tokenizer) > rows:
        raise ConfigError(
            f"{field}: {path_or_id} has a tokenizer of {len(tokenizer)} tokens but an embedding of {rows} rows; "
            "expected a tokenizer saved with this model (ids beyond the embedding fail with 'index out of range')"
        )
