"""`rloo-engine` command line: `train` (YAML + TRL-style flags), `evaluate`, `tiny-assets`, `vllm-serve`.

`rloo-engine train` accepts the flags of `trl rloo`, so a TRL command line runs after swapping
`trl rloo` for `rloo-engine train`. Flags override the YAML file given with `--config`.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import sys
import traceback
import types
import typing
from pathlib import Path
from typing import Any

from rloo_engine import exit_codes
from rloo_engine.argparsing import StrictArgumentParser
from rloo_engine.config import RLOOConfig, build_config
from rloo_engine.config_base import ConfigError, load_yaml

# Each command with the line `rloo-engine --help` shows for it.
COMMANDS = {
    "train": "train a policy with RLOO (YAML --config, overridden by TRL-style flags)",
    "evaluate": "judge policy / SFT / reference completions pairwise: win rates with CIs (EvalConfig YAML)",
    "tiny-assets": "write a tiny policy and prompt file for smoke runs (offline, seconds)",
    "vllm-serve": "start vLLM's OpenAI server for `vllm_mode: server` (weight transfer on, processed log-probs)",
}

# `trl rloo` / HF TrainingArguments flags that have no meaning here; accepted so TRL command lines
# keep working, and reported so nobody believes they took effect.
IGNORED_TRL_FLAGS = {
    "report_to", "push_to_hub", "hub_model_id", "logging_dir", "eval_strategy", "eval_steps",
    "dataset_test_split", "trust_remote_code",
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
    p = StrictArgumentParser(
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


def main_help() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: rloo-engine <command> [options]", "", "commands:"]
    lines += [f"  {name:<{width}}  {summary}" for name, summary in COMMANDS.items()]
    lines += ["", "`rloo-engine <command> --help` lists the options of a command."]
    return "\n".join(lines)


def outputs_report(result, cfg: RLOOConfig) -> str:
    """Where a finished `train` wrote its outputs: final model, metrics, checkpoints, the MLflow run."""
    from rloo_engine.run.checkpoint import checkpoint_dirs

    out = Path(cfg.output_dir)
    checkpoints = checkpoint_dirs(out)
    lines = [
        f"rloo-engine: trained {result.global_step} steps; outputs in {out}/",
        f"  final model   {result.final_dir or 'not saved'}",
        f"  metrics       {result.metrics_path}",
        f"  checkpoints   {', '.join(p.name for p in checkpoints) if checkpoints else 'none kept'}"
        + (" (resume with --resume_from_checkpoint latest)" if checkpoints else ""),
        f"  completions   {out / 'completions.jsonl'}",
    ]
    tracking_uri = os.environ.get("MLFLOW_TRACKING_URI")
    run_id = getattr(result, "mlflow_run_id", None) or os.environ.get("MLFLOW_RUN_ID")
    if run_id:
        lines.append(f"  MLflow run    {run_id} at {tracking_uri or 'the default tracking URI'}")
    elif tracking_uri:
        experiment = os.environ.get("MLFLOW_EXPERIMENT_NAME", "rloo-engine")
        lines.append(f"  MLflow run    {cfg.run_name or 'a new run'} in experiment {experiment} at {tracking_uri}")
    else:
        lines.append("  MLflow run    none (set MLFLOW_TRACKING_URI to log to MLflow)")
    return "\n".join(lines)


def _start_train_process(cfg: RLOOConfig) -> None:
    """Before torch is even imported: die with the launcher if asked, and (rank 0) take the output_dir lock,
    so a second run into the same directory is refused in about a second, not after its models load."""
    from rloo_engine.lifetime import die_with_parent_if_asked
    from rloo_engine.run.lock import acquire_run_lock

    die_with_parent_if_asked()
    if int(os.environ.get("RANK", "0")) == 0:
        acquire_run_lock(cfg.output_dir)  # the trainer takes this same lock over and releases it at the end


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(main_help())
        return 0 if argv else 2
    if argv[0] not in COMMANDS:
        close = difflib.get_close_matches(argv[0], list(COMMANDS), n=1)
        hint = f"; did you mean {close[0]}?" if close else ""
        print(f"rloo-engine: error: unknown command {argv[0]!r}{hint} (one of {', '.join(COMMANDS)}; "
              "`rloo-engine --help` describes them)", file=sys.stderr)
        return 2
    command, rest = argv[0], argv[1:]
    try:
        if command == "train":
            cfg = parse_train_args(rest)
            _start_train_process(cfg)
            from rloo_engine.distributed import end_process_group
            from rloo_engine.trainer import train

            try:
                result = train(cfg)
            except BaseException as err:
                traceback.clear_frames(err.__traceback__)  # the failed trainer's frames hold its model, so the group
                end_process_group(after_error=True)
                raise
            end_process_group()
            if int(os.environ.get("RANK", "0")) == 0:  # one report per run, not one per process
                print(outputs_report(result, cfg), flush=True)
            return 0
        if command == "evaluate":
            from rloo_engine.evaluation.cli import main as evaluate_main

            return evaluate_main(rest)
        if command == "vllm-serve":
            from rloo_engine.generation.vllm_serve import main as vllm_serve_main

            return vllm_serve_main(rest)
        from rloo_engine.testing.tiny_models import tiny_assets_main

        return tiny_assets_main(rest)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return exit_codes.CONFIG_ERROR
    except Exception as err:
        code = _failure_exit_code(err)
        if code is None:
            raise
        print(f"error: {err}", file=sys.stderr)
        return code


def _failure_exit_code(err: Exception) -> int | None:
    """The exit code of a failure whose message says what to do (so one line, no traceback), or None."""
    import errno

    from rloo_engine.generation.vllm_client import VLLMServerError
    from rloo_engine.reward_sources import RewardError
    from rloo_engine.run.checkpoint import CheckpointWriteError

    if isinstance(err, RewardError):
        return exit_codes.REWARD_ERROR
    if isinstance(err, VLLMServerError):
        return exit_codes.GENERATOR_ERROR
    if isinstance(err, CheckpointWriteError) or (isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT)):
        return exit_codes.DISK_ERROR
    return None
