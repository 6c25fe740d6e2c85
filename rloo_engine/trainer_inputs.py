"""`RLOOTrainer(model=..., reward_funcs=..., args=..., train_dataset=..., ...)` as TRL takes it: the arguments
checked and resolved into the config the engine runs and the objects it uses instead of loading them.

Objects stay in the process that made them: under `accelerate launch` every process runs the script and builds
its own. What cannot reach another process (a callable in a pipeline config, a model object for a vLLM server)
is refused where it is given, in one line.
"""

from __future__ import annotations

import copy
import hashlib
import json
import sys
from dataclasses import dataclass, field
from typing import Any

import datasets
import torch

from rloo_engine.config import RLOOConfig
from rloo_engine.config_base import ConfigError
from rloo_engine.data import DataError, _validate_prompts, load_prompt_dataset
from rloo_engine.models import load_tokenizer
from rloo_engine.trl_fields import DEFAULT_DIFFERENCES


@dataclass
class TrainerInputs:
    """What the arguments gave as objects; None/empty: load what the config names (the `rloo-engine train` case)."""

    policy: torch.nn.Module | None = None  # `model` as an object (a PreTrainedModel or a PeftModel)
    reference: torch.nn.Module | None = None  # a copy of it made before training touched it, when one is needed
    tokenizer: Any = None  # `processing_class`
    reward_funcs: list | None = None  # TRL's mixed list (paths, model ids, model objects, callables)
    reward_tokenizers: list | None = None  # `reward_processing_classes`, one per entry of reward_funcs
    train_dataset: Any = None  # a datasets.Dataset or IterableDataset
    eval_datasets: dict[str, datasets.Dataset] = field(default_factory=dict)  # "" = the one eval dataset
    peft_config: Any = None
    callbacks: list = field(default_factory=list)
    config_only: bool = False  # `RLOOTrainer(cfg)`: the config says where the run starts, checked at construction
    unset_differences: list[str] = field(default_factory=list)  # TRL defaults kept different and left unset

    def describe(self) -> dict[str, Any]:
        """What a checkpoint records of the objects, so a resume with other data or rewards is refused."""
        return {
            "model": None if self.policy is None else type(self.policy).__name__,
            "processing_class": None if self.tokenizer is None else type(self.tokenizer).__name__,
            "train_dataset": _fingerprint(self.train_dataset),
            "reward_funcs": None if self.reward_funcs is None else [_label(f) for f in self.reward_funcs],
        }


def resolve_trainer_arguments(
    model: Any, reward_funcs: Any, args: RLOOConfig | None, train_dataset: Any, eval_dataset: Any,
    processing_class: Any, reward_processing_classes: Any, callbacks: list | None, peft_config: Any,
) -> tuple[RLOOConfig, TrainerInputs]:
    """The run's config (args with what the objects say filled in) and the objects; ConfigError naming the
    argument for anything the engine cannot take, before any model or data is loaded."""
    config_only = isinstance(model, RLOOConfig) and args is None
    if config_only:  # RLOOTrainer(cfg): the engine's own shorthand
        model, args = None, model
    if args is not None and not isinstance(args, RLOOConfig):
        raise ConfigError(f"args: a {type(args).__name__}; expected rloo_engine.RLOOConfig (TRL's option names; "
                          "build it with the same keywords)")
    inputs = TrainerInputs(callbacks=list(callbacks or []), peft_config=peft_config, config_only=config_only)
    update: dict[str, Any] = {}
    if args is None:
        args = RLOOConfig(output_dir=f"{_model_name(model)}-RLOO")  # TRL's default output_dir
    if not config_only:  # said once at start, as the command line says it (cli.default_differences)
        inputs.unset_differences = [
            f"rloo-engine: {name}: {json.dumps(ours)} here (TRL: {json.dumps(trl)}) because {why}; "
            f"RLOOConfig({name}=True) gives TRL's"
            for name, (ours, trl, why) in DEFAULT_DIFFERENCES.items() if name not in args.model_fields_set]
    if isinstance(model, str):
        update["model_name_or_path"] = model
    elif isinstance(model, torch.nn.Module):
        inputs.policy = model
        update["model_name_or_path"] = getattr(model, "name_or_path", None) or None
        if hasattr(model, "peft_config"):  # a PeftModel: train its adapters, reference = adapters off
            update["use_peft"] = True
    elif model is not None:
        raise ConfigError(f"model: a {type(model).__name__}; expected a model id or directory, a PreTrainedModel "
                          "or a PeftModel")
    if peft_config is not None:
        if hasattr(model, "peft_config"):
            raise ConfigError("peft_config: given with a PeftModel as `model`; the model already has its adapters")
        update.update(use_peft=True, **_lora_fields(peft_config))
    if reward_funcs is not None:
        inputs.reward_funcs = reward_funcs if isinstance(reward_funcs, list) else [reward_funcs]
        update["reward_funcs"] = []  # the list above replaces the config's
        for i, item in enumerate(inputs.reward_funcs):
            if not (isinstance(item, (str, torch.nn.Module)) or callable(item)):
                raise ConfigError(f"reward_funcs[{i}]: a {type(item).__name__}; expected a 'module:function' path, "
                                  "a reward model id or directory, a sequence-classifier model or a callable")
        inputs.reward_tokenizers = _per_reward(reward_processing_classes, len(inputs.reward_funcs))
    cfg = _with(args, update)
    inputs.train_dataset = _train_dataset(train_dataset, cfg)
    inputs.eval_datasets = _eval_datasets(eval_dataset, cfg)
    if inputs.policy is not None and cfg.has_reference_model and not cfg.use_peft:
        inputs.reference = copy.deepcopy(inputs.policy)  # before LoRA or checkpointing touch the object
    inputs.tokenizer = processing_class
    sources = (len(inputs.reward_funcs) + bool(cfg.reward_model_name_or_path)) if inputs.reward_funcs is not None else None
    cfg.check_inputs(reward_sources=sources, has_dataset=inputs.train_dataset is not None or None,
                     has_model=inputs.policy is not None or None)
    if cfg.use_vllm and inputs.policy is not None and not cfg.model_name_or_path:
        raise ConfigError("model: an object without `name_or_path` with use_vllm: true; vLLM builds its engine from "
                          "a directory or hub id before it takes the trained weights: save_pretrained it first")
    return cfg, inputs


def prepared_tokenizer(tokenizer: Any, cfg: RLOOConfig, policy: torch.nn.Module | None) -> Any:
    """`processing_class` made ready as `load_tokenizer` makes a loaded one (pad token, left padding), or the
    tokenizer of the model's directory."""
    if tokenizer is None:
        path = cfg.model_name_or_path or getattr(policy, "name_or_path", None)
        if not path:
            raise ConfigError("processing_class: not given, and the model object has no name_or_path to load a "
                              "tokenizer from; pass processing_class=AutoTokenizer.from_pretrained(...)")
        return load_tokenizer(path, cfg)
    tokenizer = getattr(tokenizer, "tokenizer", tokenizer)  # a processor: its text tokenizer
    if tokenizer.eos_token_id is None:
        raise ConfigError("processing_class: the tokenizer has no eos_token; completions could never end")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return tokenizer


def train_prompts(cfg: RLOOConfig, inputs: TrainerInputs) -> Any:
    """The training prompts: the object given (a Dataset, or a stream read as `prompt_stream.py` says), else
    `dataset_name`'s `dataset_train_split`."""
    if inputs.train_dataset is None:
        return load_prompt_dataset(cfg.dataset_name, cfg.dataset_config, cfg.dataset_train_split)
    if isinstance(inputs.train_dataset, datasets.IterableDataset):
        from rloo_engine.prompt_stream import StreamedPrompts

        return StreamedPrompts(inputs.train_dataset)
    return inputs.train_dataset


def eval_prompts(cfg: RLOOConfig, inputs: TrainerInputs) -> dict[str, datasets.Dataset]:
    """The eval datasets by name ("" for a single one): those given, else `dataset_test_split` of `dataset_name`."""
    if cfg.eval_strategy == "no" and not cfg.eval_on_start:
        return {}
    if inputs.eval_datasets:
        return inputs.eval_datasets
    if cfg.dataset_name is None:
        raise ConfigError(f"eval_strategy: {cfg.eval_strategy!r} without an eval dataset; pass "
                          "RLOOTrainer(eval_dataset=...) or a dataset_name with a `dataset_test_split` split")
    from pathlib import Path

    if Path(cfg.dataset_name).expanduser().is_file():
        raise ConfigError(f"eval_strategy: {cfg.eval_strategy!r}, but dataset_name {cfg.dataset_name} is one file, "
                          f"which has no {cfg.dataset_test_split!r} split of held-out prompts; give a dataset with "
                          "one (a directory or hub id), or eval_dataset from Python")
    return {"": load_prompt_dataset(cfg.dataset_name, cfg.dataset_config, cfg.dataset_test_split)}


# ---------------------------------------------------------------- helpers


def _with(args: RLOOConfig, update: dict[str, Any]) -> RLOOConfig:
    if not update:
        return args
    try:
        return RLOOConfig.model_validate({**args.model_dump(), **update})
    except Exception as err:
        raise ConfigError(f"RLOOTrainer: {err}") from None


def _model_name(model: Any) -> str:
    name = model if isinstance(model, str) else getattr(model, "name_or_path", "") or type(model).__name__
    return str(name).rstrip("/").split("/")[-1] or "model"


def _lora_fields(peft_config: Any) -> dict[str, Any]:
    """The config fields a peft LoraConfig sets (recorded with the run); the object itself wraps the model."""
    if not hasattr(peft_config, "peft_type"):
        raise ConfigError(f"peft_config: a {type(peft_config).__name__}; expected a peft config such as LoraConfig")
    fields = {"lora_r": "r", "lora_alpha": "lora_alpha", "lora_dropout": "lora_dropout", "use_rslora": "use_rslora",
              "use_dora": "use_dora", "lora_modules_to_save": "modules_to_save"}
    values = {ours: getattr(peft_config, theirs) for ours, theirs in fields.items() if hasattr(peft_config, theirs)}
    targets = getattr(peft_config, "target_modules", None)
    if targets is not None:
        values["lora_target_modules"] = targets if isinstance(targets, str) else sorted(targets)
    if values.get("lora_modules_to_save") is not None:
        values["lora_modules_to_save"] = list(values["lora_modules_to_save"])
    return values


def _per_reward(classes: Any, n: int) -> list | None:
    if classes is None:
        return None
    classes = classes if isinstance(classes, list) else [classes]
    if len(classes) != n:
        raise ConfigError(f"reward_processing_classes: {len(classes)} given for {n} reward_funcs; expected one per "
                          "reward function (None where it needs none)")
    return classes


def _train_dataset(dataset: Any, cfg: RLOOConfig) -> Any:
    if dataset is None:
        return None
    if isinstance(dataset, (datasets.DatasetDict, datasets.IterableDatasetDict, dict)):
        raise ConfigError(f"train_dataset: a {type(dataset).__name__} of splits {sorted(dataset)}; pass one split, "
                          "e.g. dataset['train']")
    if isinstance(dataset, datasets.IterableDataset):
        if cfg.max_steps <= 0:
            raise ConfigError("train_dataset: an IterableDataset has no length, so the run cannot be counted in "
                              "epochs; set max_steps (as TRL requires)")
        return dataset
    if not isinstance(dataset, datasets.Dataset):
        raise ConfigError(f"train_dataset: a {type(dataset).__name__}; expected a datasets.Dataset or IterableDataset")
    _validate_prompts(dataset, "train_dataset")
    return dataset


def _eval_datasets(dataset: Any, cfg: RLOOConfig) -> dict[str, datasets.Dataset]:
    if dataset is None:
        return {}
    named = dict(dataset) if isinstance(dataset, (dict, datasets.DatasetDict, datasets.IterableDatasetDict)) else {
        "": dataset}
    for name, ds in named.items():
        where = f"eval_dataset[{name!r}]" if name else "eval_dataset"
        if isinstance(ds, datasets.IterableDataset):  # evaluated whole each time: read it once
            ds = named[name] = datasets.Dataset.from_list(list(ds))
        if not isinstance(ds, datasets.Dataset):
            raise ConfigError(f"{where}: a {type(ds).__name__}; expected a datasets.Dataset or IterableDataset")
        try:
            _validate_prompts(ds, where)
        except DataError as err:
            raise ConfigError(str(err)) from None
    if cfg.eval_strategy == "no" and not cfg.eval_on_start:
        print("rloo-engine: eval_dataset given with eval_strategy 'no': it is not evaluated (set eval_strategy)",
              file=sys.stderr)
    return named


def _fingerprint(dataset: Any) -> str | None:
    """Of the content, cheaply: size, columns and 16 rows spread over it (datasets' own fingerprint changes with
    the file's modification time, so a script that rewrites its data file could never resume). A stream: its
    features."""
    if dataset is None:
        return None
    if not isinstance(dataset, datasets.Dataset):
        return f"{type(dataset).__name__}:{dataset.features}"
    n = len(dataset)
    rows = [dataset[i] for i in sorted({i * (n - 1) // 15 for i in range(16)})] if n else []
    summary = json.dumps([n, dataset.column_names, rows], sort_keys=True, default=_by_content)
    return hashlib.sha256(summary.encode()).hexdigest()[:16]


def _by_content(value: Any) -> str:
    """A value JSON cannot write, as text that depends only on its content: an image by its pixels (its `str`
    holds its memory address, so no run could resume)."""
    if callable(getattr(value, "tobytes", None)) and hasattr(value, "mode"):  # a PIL image
        return f"image {value.mode} {value.size} {hashlib.sha256(value.tobytes()).hexdigest()[:16]}"
    return str(value)


def _label(item: Any) -> str:
    if isinstance(item, str):
        return item
    if isinstance(item, torch.nn.Module):
        return getattr(item, "name_or_path", "") or type(item).__name__
    return f"{getattr(item, '__module__', '?')}:{getattr(item, '__qualname__', type(item).__name__)}"
