"""The options whose meaning depends on the machine and the launch (tf32, log_level, 4/8-bit loading, Liger kernels,
a DeepSpeed JSON): applied, or refused with one line naming the option and why, before any model loads.

A config file is validated wherever it is read (a laptop, a CPU orchestrator); these are checked where the run is.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import sys
from pathlib import Path

import torch

from rloo_engine.config import RLOOConfig
from rloo_engine.config_base import ConfigError


def check_machine_flags(cfg: RLOOConfig, has_cuda: bool | None = None) -> None:
    """Raises ConfigError for an option this machine cannot honour (never silently ignored)."""
    has_cuda = torch.cuda.is_available() if has_cuda is None else has_cuda
    if cfg.tf32 and not tf32_available():
        raise ConfigError("tf32: true needs an NVIDIA GPU of the Ampere generation or newer (CUDA >= 11), and this "
                          "machine has none (transformers refuses it the same way); leave tf32 unset or false")
    needs = {"load_in_4bit": ("bitsandbytes", "bitsandbytes"), "load_in_8bit": ("bitsandbytes", "bitsandbytes"),
             "use_liger_kernel": ("liger_kernel", "liger-kernel")}
    for field, (module, package) in needs.items():
        if not getattr(cfg, field):
            continue
        if not has_cuda:
            raise ConfigError(f"{field}: true needs a CUDA GPU ({package}'s kernels are CUDA-only) and this machine "
                              f"has none; set {field}: false here")
        if importlib.util.find_spec(module) is None:
            raise ConfigError(f"{field}: true needs the `{package}` package, which is not installed; "
                              f"pip install {package}")
    tracking = [name for name in ("MLFLOW_TRACKING_URI", "MLFLOW_RUN_ID") if os.environ.get(name)]
    if "mlflow" in cfg.trackers() and tracking and importlib.util.find_spec("mlflow") is None:
        raise ConfigError(f"report_to: {', '.join(cfg.report_to)} logs to MLflow when {tracking[0]} is set, as it "
                          "is here, but the mlflow package is not installed (the engine alone does not bring it); "
                          "pip install 'rloo-pipeline[mlflow]', or report_to: none")


def tf32_available() -> bool:
    from transformers.utils import is_torch_tf32_available

    return is_torch_tf32_available()


def apply_machine_flags(cfg: RLOOConfig, is_main_process: bool) -> None:
    """tf32 and log_level, as transformers' TrainingArguments applies them."""
    if cfg.tf32 is not None and tf32_available():
        from transformers.utils.import_utils import enable_tf32

        enable_tf32(cfg.tf32)
    if cfg.log_level != "passive":
        import transformers

        # Replicas stay at warning, as TrainingArguments' default `log_level_replica`.
        transformers.utils.logging.set_verbosity(
            transformers.utils.logging.get_log_levels_dict()[cfg.log_level if is_main_process else "warning"])


def check_deepspeed_json(cfg: RLOOConfig, launched_zero_stage: int | None) -> str | None:
    """`deepspeed: <json>` against the launch: `launched_zero_stage` is the running DeepSpeed plugin's stage, None when
    accelerate did not launch DeepSpeed. Raises ConfigError with the command to use or the setting that differs;
    returns a note for the log when they agree."""
    if cfg.deepspeed is None:
        return None
    path = Path(cfg.deepspeed)
    try:
        ds_config = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ConfigError(f"deepspeed: {path} could not be read as JSON ({err}); expected a DeepSpeed config") from None
    stage = ds_config.get("zero_optimization", {}).get("stage", 0) if isinstance(ds_config, dict) else None
    if launched_zero_stage is None:
        raise ConfigError(
            f"deepspeed: {path} needs the engine started by accelerate with DeepSpeed, which this process was not "
            "(the engine does not start DeepSpeed itself); run:\n  accelerate launch --use_deepspeed "
            f"--deepspeed_config_file {shlex.quote(str(path))} --num_processes <GPUs> -m rloo_engine {train_arguments()}"
        )
    if stage != launched_zero_stage:
        raise ConfigError(f"deepspeed: {path} has zero_optimization.stage {stage}, but the launch profile runs ZeRO "
                          f"stage {launched_zero_stage}; make them agree (or launch with --deepspeed_config_file "
                          f"{shlex.quote(str(path))})")
    launched_file = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
    if launched_file and Path(launched_file).resolve() == path.resolve():
        return None
    return (f"deepspeed: {path} agrees with the launch profile's ZeRO stage {stage}; the launch profile's DeepSpeed "
            "settings are the ones that run")


def train_arguments() -> str:
    """This process's `train ...` arguments, quoted for a shell (what to put after `-m rloo_engine`)."""
    args = sys.argv[1:]
    return shlex.join(args) if args[:1] == ["train"] else "train " + shlex.join(args)


def settle_machine_flags(cfg: RLOOConfig, acc, say) -> None:
    """Everything above for the trainer, right after the Accelerator is built and before any model loads."""
    from rloo_engine.distributed import is_deepspeed, zero_stage

    check_machine_flags(cfg)
    if note := check_deepspeed_json(cfg, zero_stage(acc) if is_deepspeed(acc) else None):
        say(note)
    apply_machine_flags(cfg, acc.is_main_process)
