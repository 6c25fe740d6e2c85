"""`rloo-engine` command line: `train` (YAML + TRL-style flags), `evaluate`, `tiny-assets`, `vllm-serve`.

`rloo-engine train` accepts the flags of `trl rloo`, so a TRL command line runs after swapping
`trl rloo` for `rloo-engine train`. Flags override the YAML file given with `--config`.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import importlib.util
import json
import os
import sys
import traceback
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rloo_engine import exit_codes
from rloo_engine.argparsing import StrictArgumentParser
from rloo_engine.config import RLOOConfig, build_config
from rloo_engine.config_base import ConfigError, load_yaml
from rloo_engine.trl_fields import ALIASES, DEFAULT_DIFFERENCES, TRL_FIELDS, hide_gpus, translate, trl_scalar

# Each command with the line `rloo-engine --help` shows for it.
COMMANDS = {
    "train": "train a policy with RLOO (YAML --config, overridden by TRL-style flags)",
    "evaluate": "judge policy / SFT / reference completions pairwise: win rates with CIs (EvalConfig YAML)",
    "tiny-assets": "write a tiny policy and prompt file for smoke runs (offline, seconds)",
    "vllm-serve": "start vLLM's OpenAI server for `vllm_mode: server` (weight transfer on, processed log-probs)",
    "mlflow-sync": "send MLflow what a run's tracking server did not take (its metrics.jsonl rows, files, status)",
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


def _int_or_fraction(text: str) -> int | float:
    """An int, or (TRL's ratio of the run, e.g. `--warmup_steps 0.1`) a number below 1 for trl_fields to read."""
    try:
        return int(text)
    except ValueError:
        return float(text)


def _spellings(name: str) -> list[str]:
    """`--num_train_epochs` and, as TRL's HfArgumentParser adds, `--num-train-epochs`."""
    return [f"--{name}"] + ([f"--{name.replace('_', '-')}"] if "_" in name else [])


def _add_field_flag(parser: argparse.ArgumentParser, name: str, field) -> None:
    """Adds `--name` (and `--name-with-dashes`) parsing into the field's type; list fields take several values;
    a bool field also gets TRL's `--no_name`."""
    annotation = field.annotation
    optional = False
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and type(None) in args:
        optional = True
        annotation = next(a for a in args if a is not type(None))
    origin = typing.get_origin(annotation)
    default = json.dumps(field.default_factory() if field.default_factory is not None else field.default, default=str)
    if name in DEFAULT_DIFFERENCES:
        default += f"; TRL: {json.dumps(DEFAULT_DIFFERENCES[name][1])}, see the note printed at start"
    help_text = f"{field.description or ''} (default: {'required' if field.is_required() else default})"
    kw: dict[str, Any] = {"dest": name, "default": argparse.SUPPRESS, "help": help_text}
    if annotation is bool:
        kw.update(nargs="?", const=True, type=_truthy, metavar="BOOL")
    elif origin in (list, tuple):
        inner = typing.get_args(annotation)[0]
        kw.update(nargs="+", type=inner if inner in (int, float) else str, metavar="X")
    elif origin is dict:
        kw.update(type=_json_dict, metavar="JSON")
    elif annotation is int:
        kw.update(type=_none_or(_int_or_fraction) if optional else _int_or_fraction, metavar="INT")
    elif annotation is float:
        kw.update(type=_none_or(float) if optional else float, metavar="FLOAT")
    else:  # str and Literal
        kw.update(type=_none_or(str) if optional else str, metavar="STR")
    parser.add_argument(*_spellings(name), **kw)
    if annotation is bool:
        parser.add_argument(f"--no_{name}", f"--no-{name.replace('_', '-')}", dest=name, action="store_false",
                            default=argparse.SUPPRESS, help=argparse.SUPPRESS)


def train_parser() -> argparse.ArgumentParser:
    p = StrictArgumentParser(
        prog="rloo-engine train",
        usage="rloo-engine train [--config FILE] [--option VALUE ...]",
        description="Train a policy with RLOO. Options come from --config (YAML) and are overridden by flags.",
        epilog="Every other option of `trl rloo` is accepted, ignored (named on stderr) or refused with the reason, "
               "as the TRL table in docs/configuration.md lists.",
    )
    p.add_argument("--config", help="YAML file of options (RLOOConfig's, or a `trl rloo` config file)")
    for name, field in RLOOConfig.model_fields.items():
        _add_field_flag(p, name, field)
    for alias, ours in ALIASES.items():
        p.add_argument(f"--{alias}", dest=ours, default=argparse.SUPPRESS, help=f"Alias of --{ours} (TRL's name).")
    for name, entry in TRL_FIELDS.items():
        if name in RLOOConfig.model_fields:
            continue
        # TRL's other fields, typed by trl_fields.translate; hidden from --help, listed in docs/configuration.md.
        p.add_argument(*_spellings(name), dest=f"{_TRL}{name}", nargs="*", default=argparse.SUPPRESS,
                       help=argparse.SUPPRESS)
        if entry.trl_default is True:
            p.add_argument(f"--no_{name}", f"--no-{name.replace('_', '-')}", dest=f"{_TRL}{name}",
                           action="store_const", const=["false"], default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    return p


_TRL = "_trl_"  # namespace prefix of TRL fields that are not RLOOConfig fields


def _trl_flag_value(tokens: list[str]) -> Any:
    """A TRL-only flag's tokens typed as TRL's parser would: none is true, one is a scalar or JSON, more a list."""
    if not tokens:
        return True
    values = [json.loads(t) if t.startswith("{") else trl_scalar(t) for t in tokens]
    return values[0] if len(values) == 1 else values


@dataclass
class TrainCommand:
    """A parsed `rloo-engine train`: the config, plus what TRL's parser does to the process itself."""

    config: RLOOConfig
    use_cpu: bool = False  # TRL's `use_cpu`: hide the GPUs before torch loads
    env: dict[str, str] = dataclasses.field(default_factory=dict)  # a TRL YAML's `env:` mapping
    given: set[str] = dataclasses.field(default_factory=set)  # options the user set (YAML or flags)


def parse_train_command(argv: list[str]) -> TrainCommand:
    """YAML (if `--config`) overlaid with command-line flags, TRL spellings translated (rloo_engine/trl_fields.py),
    validated into an RLOOConfig. Ignored TRL options are named on one stderr line; refused ones are a ConfigError."""
    ns = vars(train_parser().parse_args(argv))
    config_path = ns.pop("config", None)
    yaml_values = load_yaml(config_path) if config_path else {}
    env = yaml_values.pop("env", None) or {}
    if not isinstance(env, dict):
        raise ConfigError(f"--config: env: {env!r}; expected a mapping of VARIABLE: value")
    flags = {k.removeprefix(_TRL): _trl_flag_value(v) if k.startswith(_TRL) else v for k, v in ns.items()}
    ours = set(RLOOConfig.model_fields)
    from_yaml = translate(yaml_values, ours, f"--config {config_path}")
    from_flags = translate(flags, ours, "rloo-engine train")
    if refused := from_yaml.refused + from_flags.refused:
        raise ConfigError("\n".join(refused))
    if ignored := sorted(set(from_yaml.ignored + from_flags.ignored)):
        print(f"rloo-engine: ignoring TRL options with no effect here (docs/configuration.md says why): "
              f"{', '.join(ignored)}", file=sys.stderr)
    values = {**from_yaml.values, **from_flags.values}
    return TrainCommand(build_config(values, source="rloo-engine train"), from_yaml.use_cpu or from_flags.use_cpu,
                        {str(k): str(v) for k, v in env.items()}, set(values))


def parse_train_args(argv: list[str]) -> RLOOConfig:
    """The RLOOConfig of a `rloo-engine train` command line (see parse_train_command)."""
    return parse_train_command(argv).config


def default_differences(command: TrainCommand) -> list[str]:
    """One line per default of TRL's kept different here and left unset by this run (printed once at start)."""
    return [f"rloo-engine: {name}: {json.dumps(ours)} here (TRL: {json.dumps(trl)}) because {why}; --{name} true "
            "gives TRL's" for name, (ours, trl, why) in DEFAULT_DIFFERENCES.items() if name not in command.given]


def main_help() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: rloo-engine <command> [options]", "", "commands:"]
    lines += [f"  {name:<{width}}  {summary}" for name, summary in COMMANDS.items()]
    lines += ["", "`rloo-engine <command> --help` lists the options of a command."]
    return "\n".join(lines)


def completions_line(out: Path, cfg: RLOOConfig) -> str:
    """`completions.jsonl` when the run wrote it (log_completions, or a reward function's `log_extra` columns)."""
    if (out / "completions.jsonl").is_file():
        return str(out / "completions.jsonl")
    return "none (log_completions: false)" if not cfg.log_completions else "none written"


def outputs_report(result, cfg: RLOOConfig) -> str:
    """Where a finished `train` wrote its outputs: final model, metrics, checkpoints, the MLflow run."""
    from rloo_engine.run.checkpoint import checkpoint_dirs

    out = Path(cfg.output_dir)
    checkpoints = checkpoint_dirs(out)
    lines = [
        f"rloo-engine: trained {result.global_step} steps; outputs in {out}/",
        f"  final model   {result.final_dir or 'not saved'}"
        + (" (the LoRA adapter, PEFT layout)" if cfg.use_peft and result.final_dir else ""),
        *([f"  merged model  {out / 'final-merged'}"] if (out / "final-merged").is_dir() else []),
        f"  metrics       {result.metrics_path}",
        f"  checkpoints   {', '.join(p.name for p in checkpoints) if checkpoints else 'none kept'}"
        + (" (resume with --resume_from_checkpoint latest)" if checkpoints else ""),
        f"  completions   {completions_line(out, cfg)}",
    ]
    tracking_uri = os.environ.get("MLFLOW_TRACKING_URI")
    run_id = getattr(result, "mlflow_run_id", None) or os.environ.get("MLFLOW_RUN_ID")
    others = [t for t in cfg.trackers() if t != "mlflow"]
    if others:
        where = {"tensorboard": "runs", "wandb": "wandb"}
        lines.append("  trackers      " + ", ".join(f"{t} in {out / where[t]}/" for t in others))
    if "mlflow" not in cfg.trackers():
        lines.append(f"  MLflow run    none (report_to: {', '.join(cfg.report_to) or 'none'})")
    elif run_id:
        lines.append(f"  MLflow run    {run_id} at {tracking_uri or 'the default tracking URI'}")
    elif tracking_uri:
        experiment = os.environ.get("MLFLOW_EXPERIMENT_NAME", "rloo-engine")
        lines.append(f"  MLflow run    {cfg.run_name or 'a new run'} in experiment {experiment} at {tracking_uri}")
    else:
        install = "" if importlib.util.find_spec("mlflow") else " and pip install 'rloo-pipeline[mlflow]'"
        lines.append(f"  MLflow run    none (set MLFLOW_TRACKING_URI{install} to log to MLflow)")
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
            parsed = parse_train_command(rest)
            cfg = parsed.config
            os.environ.update(parsed.env)
            if parsed.use_cpu:
                hide_gpus()
            if int(os.environ.get("RANK", "0")) == 0:
                for line in default_differences(parsed):
                    print(line, file=sys.stderr)
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
        if command == "mlflow-sync":
            return mlflow_sync_main(rest)
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


def mlflow_sync_main(argv: list[str]) -> int:
    """`rloo-engine mlflow-sync OUTPUT_DIR`: what the run's MLflow server did not take while it trained (its
    `mlflow_pending.json`): the missing rows of `metrics.jsonl`, the files, the end status. Exit 1 while it still
    fails (run it again later)."""
    from rloo_engine.argparsing import StrictArgumentParser
    from rloo_engine.mlflow_sender import sync_output_dir

    parser = StrictArgumentParser(prog="rloo-engine mlflow-sync", description=mlflow_sync_main.__doc__)
    parser.add_argument("output_dir", help="the run's output_dir")
    return sync_output_dir(parser.parse_args(argv).output_dir)


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
