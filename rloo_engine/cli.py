"""`rloo-engine` command line: `train` (YAML + TRL-style flags), `evaluate`, `tiny-assets`.

`rloo-engine train` accepts the flags of `trl rloo`, so a TRL command line runs after swapping
`trl rloo` for `rloo-engine train`. Flags override the YAML file given with `--config`.
"""

from __future__ import annotations

import argparse
import json
import sys
import types
import typing
from typing import Any

from rloo_engine.config import ConfigError, RLOOConfig, build_config, load_yaml

# `trl rloo` / HF TrainingArguments flags that have no meaning here; accepted so TRL command lines
# keep working, and reported so nobody believes they took effect.
IGNORED_TRL_FLAGS = {
    "report_to", "push_to_hub", "hub_model_id", "logging_dir", "eval_strategy", "eval_steps",
    "dataset_test_split", "trust_remote_code", "overwrite_output_dir",
    "save_strategy", "logging_strategy", "dataloader_num_workers", "remove_unused_columns",
}


def _truthy(text: str) -> bool:
    low = text.lower()
    if low in ("1", "true", "yes", "y", "on"):
        return True
    if low in ("0", "false", "no", "n", "off"):
        return False
    raise argparse.ArgumentTypeError(f"{text!r} is not a boolean; expected true or false")


def _none_or(parse):
    def parse_optional(text: str):
        return None if text.lower() in ("none", "null") else parse(text)

    return parse_optional


def _json_dict(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"{text!r} is not JSON: {err}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{text!r}; expected a JSON object")
    return value


def _add_field_flag(parser: argparse.ArgumentParser, name: str, annotation: Any, help_text: str) -> None:
    """Adds `--name` parsing into the field's type; list fields take several values."""
    optional = False
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and type(None) in args:
        optional = True
        annotation = next(a for a in args if a is not type(None))
    origin = typing.get_origin(annotation)
    kw: dict[str, Any] = {"dest": name, "default": argparse.SUPPRESS, "help": help_text}
    if annotation is bool:
        kw.update(nargs="?", const=True, type=_truthy)
    elif origin in (list, tuple):
        inner = typing.get_args(annotation)[0]
        kw.update(nargs="+", type=inner if inner in (int, float) else str)
    elif origin is dict:
        kw.update(type=_json_dict)
    elif annotation in (int, float):
        kw.update(type=_none_or(annotation) if optional else annotation)
    else:  # str and Literal
        kw.update(type=_none_or(str) if optional else str)
    parser.add_argument(f"--{name}", **kw)


def train_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="rloo-engine train",
        description="Train a policy with RLOO. Options come from --config (YAML) and are overridden by flags.",
    )
    p.add_argument("--config", help="YAML file of RLOOConfig options")
    for name, field in RLOOConfig.model_fields.items():
        _add_field_flag(p, name, field.annotation, field.description or "")
    p.add_argument("--torch_dtype", dest="dtype", default=argparse.SUPPRESS, help="Alias of --dtype (TRL name).")
    for flag in sorted(IGNORED_TRL_FLAGS):
        p.add_argument(f"--{flag}", dest=f"_ignored_{flag}", default=argparse.SUPPRESS, nargs="?", help=argparse.SUPPRESS)
    return p


def parse_train_args(argv: list[str]) -> RLOOConfig:
    """YAML (if `--config`) overlaid with command-line flags, validated into an RLOOConfig."""
    ns = vars(train_parser().parse_args(argv))
    ignored = sorted(k.removeprefix("_ignored_") for k in ns if k.startswith("_ignored_"))
    if ignored:
        print(f"rloo-engine: ignoring TRL flags with no effect here: {', '.join(ignored)}", file=sys.stderr)
    values = load_yaml(ns.pop("config")) if ns.get("config") else {}
    ns.pop("config", None)
    values.update({k: v for k, v in ns.items() if not k.startswith("_ignored_")})
    return build_config(values, source="rloo-engine train")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = ("train", "evaluate", "tiny-assets")
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in commands:
        print(f"usage: rloo-engine {{{','.join(commands)}}} [options]   (--help after a command for its options)")
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    command, rest = argv[0], argv[1:]
    try:
        if command == "train":
            cfg = parse_train_args(rest)
            from rloo_engine.trainer import train

            train(cfg)
            return 0
        if command == "evaluate":
            from rloo_engine.evaluation.cli import main as evaluate_main

            return evaluate_main(rest)
        from rloo_engine.tiny_models import tiny_assets_main

        return tiny_assets_main(rest)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
