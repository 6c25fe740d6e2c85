"""`module:attribute` import paths written in configs (reward functions, python judges), resolved with errors
that name the field, and with the new name of a module that moved."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from rloo_engine.config_base import ConfigError

# Modules renamed, so a config written for an older release fails with the path to write instead.
MOVED_MODULES = {
    # 0.3.0: generation and run-guarding in rooms of their own; rollout.py split into batch.py and logprobs.py
    "rloo_engine.generation_vllm": "rloo_engine.generation.vllm_colocate",
    "rloo_engine.generation_vllm_server": "rloo_engine.generation.vllm_server",
    "rloo_engine.vllm_server_client": "rloo_engine.generation.vllm_client",
    "rloo_engine.vllm_gloo_transfer": "rloo_engine.generation.vllm_gloo_transfer",
    "rloo_engine.vllm_serve": "rloo_engine.generation.vllm_serve",
    "rloo_engine.fused_decode": "rloo_engine.generation.fused_decode",
    "rloo_engine.kv_cache": "rloo_engine.generation.kv_cache",
    "rloo_engine.sampling": "rloo_engine.generation.sampling",
    "rloo_engine.train_preflight": "rloo_engine.run.preflight",
    "rloo_engine.run_lock": "rloo_engine.run.lock",
    "rloo_engine.run_continuity": "rloo_engine.run.continuity",
    "rloo_engine.shared_output_dir": "rloo_engine.run.shared_output_dir",
    "rloo_engine.checkpoint": "rloo_engine.run.checkpoint",
    "rloo_engine.fault_injection": "rloo_engine.run.fault_injection",
    "rloo_engine.rollout": "rloo_engine.logprobs",
    # 0.2.0
    "rloo_engine.rewards": "rloo_engine.reward_sources",
    "rloo_engine.demo.task": "rloo_engine.demo.toy_task",
    "rloo_engine.demo.reward_model": "rloo_engine.demo.reward_model_training",
    "rloo_engine.tiny_models": "rloo_engine.testing.tiny_models",
    "rloo_engine.tiny_chat_models": "rloo_engine.testing.tiny_chat_models",
    "rloo_engine.evaluation.fake_openai_server": "rloo_engine.testing.fake_openai_server",
}


def load_callable(path: str, field: str) -> Callable[..., Any]:
    """The callable named by `package.module:function` (nested attributes allowed: `module:Class.method`)."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"{field}: {path!r}; expected an import path like 'my_pkg.module:function'")
    if module_name in MOVED_MODULES:
        raise ConfigError(
            f"{field}: {path}: module {module_name!r} was moved in rloo-pipeline; "
            f"write '{MOVED_MODULES[module_name]}:{attr}'"
        )
    try:
        target: Any = importlib.import_module(module_name)
    except ImportError as err:
        missing = getattr(err, "name", None)
        if isinstance(err, ModuleNotFoundError) and missing and (module_name + ".").startswith(missing + "."):
            raise ConfigError(f"{field}: {path}: module {module_name!r} not found ({err})") from None
        raise ConfigError(f"{field}: {path}: importing module {module_name!r} failed: {err}") from None
    for part in attr.split("."):
        if not hasattr(target, part):
            raise ConfigError(f"{field}: {path}: {module_name} has no attribute {attr!r}")
        target = getattr(target, part)
    if not callable(target):
        raise ConfigError(f"{field}: {path}: {attr} is a {type(target).__name__}, not callable")
    return target
