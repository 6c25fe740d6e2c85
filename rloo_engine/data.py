"""Prompt datasets: loading and validating them, rendering prompts to text, and a resumable sampler over them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import datasets
import pyarrow.compute as pc
import torch

from rloo_engine.config_base import ConfigError

# Builder name of each data-file suffix `datasets.load_dataset` understands.
_FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
# Keyword names the reward call itself uses; a dataset column with one of them would collide.
_RESERVED_COLUMNS = ("prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric")


class DataError(ConfigError):
    """A prompt dataset is missing or malformed; the message names the dataset and what was expected."""


# ---------------------------------------------------------------- loading


def load_prompt_dataset(name: str, config: str | None = None, split: str = "train") -> datasets.Dataset:
    """Loads `split` of a prompt dataset and checks it has usable prompts.

    `name` is a .jsonl/.json/.parquet/.csv file, a directory (written by `save_to_disk`, or holding
    data files), or a hub id. Every row needs a `prompt`: all strings, or all lists of
    {"role", "content"} messages.
    """
    ds = _load_split(name, config, split)
    _validate_prompts(ds, f"dataset_name: {name}")
    return ds


def _load_split(name: str, config: str | None, split: str) -> datasets.Dataset:
    path = Path(name).expanduser()
    if path.is_file():
        builder = _FILE_BUILDERS.get(path.suffix.lower())
        if builder is None:
            raise DataError(
                f"dataset_name: {name} has suffix {path.suffix!r}; expected one of {sorted(_FILE_BUILDERS)}"
            )
        if path.stat().st_size == 0:  # datasets fails on it with a bare "StopIteration"
            raise DataError(f"dataset_name: {name} is an empty file; expected at least one row with a 'prompt'")
        # A single file has no splits of its own, so it becomes whichever split was asked for.
        return _guarded(name, lambda: datasets.load_dataset(builder, data_files={split: str(path)}, split=split))
    if path.is_dir():
        if _is_saved_to_disk(path):
            return _pick_split(name, _guarded(name, lambda: datasets.load_from_disk(str(path))), split)
        return _guarded(name, lambda: datasets.load_dataset(str(path), config, split=split))
    if _looks_like_path(name):
        raise DataError(
            f"dataset_name: {name} does not exist; expected a .jsonl/.json/.parquet/.csv file, "
            "a dataset directory or a hub id"
        )
    return _guarded(name, lambda: datasets.load_dataset(name, config, split=split))


def _is_saved_to_disk(path: Path) -> bool:
    return (path / "dataset_dict.json").is_file() or (path / "state.json").is_file()


def _looks_like_path(name: str) -> bool:
    """Hub ids are `owner/name`; anything with a file suffix or a path prefix was meant to be local."""
    return name.startswith(("/", ".", "~")) or Path(name).suffix.lower() in _FILE_BUILDERS or name.count("/") > 1


def _guarded(name: str, load: Any) -> Any:
    try:
        return load()
    except DataError:
        raise
    except Exception as err:  # datasets raises many types (FileNotFoundError, ArrowInvalid, DatasetNotFoundError ...)
        cause = err
        while cause.__cause__ is not None or cause.__context__ is not None:  # the parse error under datasets' own
            cause = cause.__cause__ or cause.__context__
        why = f"{type(err).__name__}: {err}" + (f" ({type(cause).__name__}: {cause})" if cause is not err else "")
        raise DataError(f"dataset_name: {name} could not be loaded: {why}") from err


def _pick_split(name: str, loaded: Any, split: str) -> datasets.Dataset:
    if isinstance(loaded, datasets.Dataset):
        return loaded
    if split not in loaded:
        raise DataError(f"dataset_name: {name} has splits {sorted(loaded)}; dataset_train_split {split!r} is not one")
    return loaded[split]


# ---------------------------------------------------------------- validation


def _validate_prompts(ds: datasets.Dataset, where: str) -> None:
    if "prompt" not in ds.column_names:
        raise DataError(f"{where}: no 'prompt' column; found columns {ds.column_names}")
    reserved = [c for c in _RESERVED_COLUMNS if c in ds.column_names]
    if reserved:
        raise DataError(
            f"{where}: column(s) {reserved} clash with the reward-function arguments {list(_RESERVED_COLUMNS)}; rename them"
        )
    if len(ds) == 0:
        raise DataError(f"{where}: the dataset is empty; expected at least one prompt")
    column = ds.data.column("prompt")
    if column.null_count:
        raise DataError(f"{where}: {column.null_count} row(s) have a null 'prompt'; expected a string or message list")
    feature = ds.features["prompt"]
    if _is_string_feature(feature):
        return
    if _is_messages_feature(feature):
        if pc.min(pc.list_value_length(column)).as_py() == 0:
            raise DataError(f"{where}: some 'prompt' message lists are empty; expected at least one message")
        return
    # Mixed or unusual types (datasets stores them as a Json feature): check row by row.
    _validate_prompt_rows(ds["prompt"], where)


def _is_string_feature(feature: Any) -> bool:
    return isinstance(feature, datasets.Value) and feature.dtype in ("string", "large_string")


def _is_messages_feature(feature: Any) -> bool:
    inner = getattr(feature, "feature", None)
    return isinstance(inner, dict) and "role" in inner and "content" in inner


def _validate_prompt_rows(prompts: list[Any], where: str) -> None:
    first_of_kind: dict[str, int] = {}
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            first_of_kind.setdefault("string", i)
        elif is_conversational(prompt):
            first_of_kind.setdefault("message list", i)
        else:
            raise DataError(
                f"{where}: row {i} has prompt {prompt!r:.80}; expected a string or a list of "
                '{"role": ..., "content": ...} messages'
            )
    if len(first_of_kind) > 1:
        kinds = ", ".join(f"{kind}s (first at row {row})" for kind, row in first_of_kind.items())
        raise DataError(f"{where}: column 'prompt' mixes {kinds}; expected every prompt to be the same kind")


# ---------------------------------------------------------------- prompts to text


def is_conversational(prompt: Any) -> bool:
    """True for a non-empty list of {"role", "content"} messages, False for anything else (e.g. a string)."""
    return (
        isinstance(prompt, list)
        and len(prompt) > 0
        and all(isinstance(m, dict) and "role" in m and "content" in m for m in prompt)
    )


def as_assistant_messages(completion: str) -> list[dict]:
    """A completion in TRL's conversational form: `[{"role": "assistant", "content": completion}]`."""
    return [{"role": "assistant", "content": completion}]


def completion_text(completion: str | list[dict]) -> str:
    """The text of a completion given as a string or as TRL's assistant messages."""
    return completion if isinstance(completion, str) else "".join(m["content"] for m in completion)


def render_prompt(tokenizer: Any, prompt: str | list[dict], chat_template_kwargs: dict | None = None) -> str:
    """The text the policy continues: a string prompt as is, messages through the chat template."""
    if isinstance(prompt, str):
        return prompt
    if not is_conversational(prompt):
        raise DataError(f"prompt {prompt!r:.80}; expected a string or a list of {{'role', 'content'}} messages")
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(
            f"tokenizer {getattr(tokenizer, 'name_or_path', '') or type(tokenizer).__name__} has no chat template; "
            "conversational prompts need one (set tokenizer.chat_template, or use string prompts)"
        )
    # tokenize=False: in transformers 5 tokenize=True returns a BatchEncoding, and callers tokenize in batches anyway.
    return tokenizer.apply_chat_template(
        prompt, tokenize=False, add_generation_prompt=True, **(chat_template_kwargs or {})
    )


def extra_columns(rows: list[dict]) -> dict[str, list]:
    """Every column but `prompt`, as {column: [value per row]}; reward functions receive these as kwargs."""
    if not rows:
        return {}
    return {key: [row[key] for row in rows] for key in rows[0] if key != "prompt"}


# ---------------------------------------------------------------- sampling


class PromptSampler:
    """A deterministic, resumable, endless stream of dataset indices, split across processes.

    Each call consumes `n * num_processes` indices of the global order (epoch e shuffled by
    `torch.Generator().manual_seed(seed + e)`), and rank r takes its own contiguous slice of them,
    so no two ranks get the same prompt in one step. Requests run on into the next epoch.
    """

    def __init__(self, dataset_len: int, seed: int, shuffle: bool, rank: int = 0, num_processes: int = 1):
        if dataset_len < 1:
            raise DataError(f"dataset_len: {dataset_len}; expected at least one prompt")
        if not 0 <= rank < num_processes:
            raise DataError(f"rank: {rank}; expected 0 <= rank < num_processes={num_processes}")
        self.dataset_len, self.seed, self.shuffle = dataset_len, seed, shuffle
        self.rank, self.num_processes = rank, num_processes
        self._epoch, self._position = 0, 0
        self._order: list[int] | None = None  # order of `_epoch`, built lazily

    @property
    def epoch(self) -> int:
        """Completed passes over the dataset (the epoch the next index comes from)."""
        return self._epoch

    def next_indices(self, n: int) -> list[int]:
        """This rank's next `n` indices; every rank must call this with the same `n` each step."""
        if n < 1:
            raise DataError(f"n: {n}; expected at least 1 index per request")
        step = self._take(n * self.num_processes)
        return step[self.rank * n : (self.rank + 1) * n]

    def _take(self, count: int) -> list[int]:
        taken: list[int] = []
        while len(taken) < count:
            order = self._epoch_order()
            chunk = order[self._position : self._position + count - len(taken)]
            taken.extend(chunk)
            self._position += len(chunk)
            if self._position == self.dataset_len:
                self._epoch, self._position, self._order = self._epoch + 1, 0, None
        return taken

    def _epoch_order(self) -> list[int]:
        if self._order is None:
            if self.shuffle:
                gen = torch.Generator().manual_seed(self.seed + self._epoch)
                self._order = torch.randperm(self.dataset_len, generator=gen).tolist()
            else:
                self._order = list(range(self.dataset_len))
        return self._order

    def state_dict(self) -> dict[str, int]:
        """Where the stream stands; `dataset_len` and `seed` are kept to catch resuming on other data."""
        return {"epoch": self._epoch, "position": self._position, "dataset_len": self.dataset_len, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        for key in ("dataset_len", "seed"):
            if key in state and state[key] != getattr(self, key):
                raise DataError(
                    f"sampler state: saved {key}={state[key]} but this run has {key}={getattr(self, key)}; "
                    "resuming would draw a different prompt order"
                )
        if not 0 <= state["position"] < self.dataset_len or state["epoch"] < 0:
            raise DataError(f"sampler state: {state}; expected 0 <= position < {self.dataset_len} and epoch >= 0")
        self._epoch, self._position, self._order = state["epoch"], state["position"], None
