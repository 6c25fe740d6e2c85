"""`module:attribute` import paths written in configs (reward functions, python judges), resolved with errors
that name the field, and with the new name of a module that moved."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from rloo_engine.config_base import ConfigError

# Modules renamed in 0.2.0, so a config written for 0.1 fails with the path to write instead.
MOVED_MODULES = {
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
            f"{field}: {path}: module {module_name!r} was renamed in rloo-pipeline 0.2.0; "
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
