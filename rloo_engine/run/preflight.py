"""Checks `rloo-engine train` makes before any model loads, so a bad option fails in seconds with its field named."""

from __future__ import annotations

from pathlib import Path

from rloo_engine.config import RLOOConfig
from rloo_engine.config_base import ConfigError

# Files one of which a saved tokenizer has (fast, sentencepiece, BPE/WordPiece vocabularies).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "spiece.model", "vocab.json",
                   "vocab.txt")


def check_before_loading(cfg: RLOOConfig, model_given: bool = False, tokenizer_given: bool = False) -> None:
    """Raises ConfigError for a reward function that does not import, an output_dir that is a file, or a
    reward model whose tokenizer makes ids its embedding does not have (an IndexError only after every model loaded)."""
    from rloo_engine.reward_sources import load_reward_function

    out = Path(cfg.output_dir)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"output_dir: {out} is a file; expected a directory (or a path that does not exist yet)")
    for path in cfg.reward_funcs:
        load_reward_function(path)
    if not tokenizer_given and cfg.model_name_or_path:
        check_tokenizer_saved("model_name_or_path", cfg.model_name_or_path)
    if not model_given:  # a model object's own config says its positions (the trainer checks it)
        check_completion_fits(cfg, model_position_limit(cfg.model_name_or_path, cfg.model_revision,
                                                        cfg.trust_remote_code))
    if cfg.reward_model_name_or_path:
        check_tokenizer_saved("reward_model_name_or_path", cfg.reward_model_name_or_path)
        check_tokenizer_fits_embedding("reward_model_name_or_path", cfg.reward_model_name_or_path,
                                       trust_remote_code=cfg.trust_remote_code)


def check_tokenizer_saved(field: str, path_or_id: str) -> None:
    """A local model directory must hold its tokenizer: without one, transformers 5 returns an empty tokenizer and
    training fails only after every model loaded (`IndexError: index -1 is out of bounds`)."""
    path = Path(path_or_id).expanduser()
    if path.is_dir() and not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise ConfigError(f"{field}: {path_or_id} has no tokenizer files (none of {', '.join(TOKENIZER_FILES)}); "
                          "expected the tokenizer saved beside the model (tokenizer.save_pretrained(...) into it), "
                          "or from Python RLOOTrainer(processing_class=...)")


def check_tokenizer_fits_embedding(field: str, path_or_id: str, trust_remote_code: bool = False) -> None:
    """The model's tokenizer must not have more tokens than the model has embedding rows."""
    from transformers import AutoConfig, AutoTokenizer

    try:
        config = AutoConfig.from_pretrained(path_or_id, trust_remote_code=trust_remote_code)
        tokenizer = AutoTokenizer.from_pretrained(path_or_id, trust_remote_code=trust_remote_code)
    except Exception as err:
        raise ConfigError(f"{field}: {path_or_id} could not be loaded: {type(err).__name__}: {err}") from err
    rows = getattr(config.get_text_config(), "vocab_size", None)
    if rows is not None and len(tokenizer) > rows:
        raise ConfigError(
            f"{field}: {path_or_id} has a tokenizer of {len(tokenizer)} tokens but an embedding of {rows} rows; "
            "expected a tokenizer saved with this model (ids beyond the embedding fail with 'index out of range')"
        )


def model_position_limit(path_or_id: str, revision: str | None = None, trust_remote_code: bool = False) -> int | None:
    """The policy's `max_position_embeddings` (text config), or None when its config does not say or cannot load
    here (the model load then reports that)."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(path_or_id, revision=revision, trust_remote_code=trust_remote_code)
    except Exception:
        return None
    limit = getattr(config.get_text_config(), "max_position_embeddings", None)
    return limit if isinstance(limit, int) and limit > 0 else None


def check_completion_fits(cfg: RLOOConfig, limit: int | None) -> None:
    """A completion must fit in the model's positions with at least one prompt token before it."""
    if limit is not None and cfg.max_completion_length >= limit:
        raise ConfigError(
            f"max_completion_length: {cfg.max_completion_length}, but {cfg.model_name_or_path} has "
            f"max_position_embeddings {limit}; expected at most {limit - 1} (prompt and completion share them)"
        )


def prompt_token_budget(cfg: RLOOConfig, limit: int | None, say=lambda message: None) -> int | None:
    """Prompt tokens kept (from the end): max_prompt_length, cut so prompt + completion fit the model's positions
    (`say` gets a line when it is cut).

    vLLM refuses a max_model_len beyond max_position_embeddings, and models with learned positions fail past it,
    so the default 512-token prompt budget shrinks on a 512-position model instead of failing at the first step.
    """
    if limit is None:
        return cfg.max_prompt_length
    room = limit - cfg.max_completion_length
    budget = room if cfg.max_prompt_length is None else min(cfg.max_prompt_length, room)
    if budget != cfg.max_prompt_length:
        say(f"rloo-engine: max_prompt_length {cfg.max_prompt_length or 'unlimited'} + max_completion_length "
            f"{cfg.max_completion_length} exceeds the model's {limit} positions; prompts keep their last {budget} "
            "tokens")
    return budget
