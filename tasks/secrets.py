"""Secrets at run time: read from Prefect Secret blocks (or the worker's environment), handed to one consumer
through `rloo_engine.services.scoped_env` and `rloo_engine.pipeline.environment.child_env`.

A secret is never a flow parameter, never logged and never written to a config file. The training
process receives its secrets through its own environment only; the judge's key is visible to the
evaluation only while it runs, and the training process never inherits it.
"""

from __future__ import annotations

from rloo_engine.config_base import ConfigError


def read_secret_block(block_name: str, field: str) -> str:
    """The value of the Prefect Secret block `block_name`, as a string."""
    from prefect.blocks.system import Secret

    try:
        value = Secret.load(block_name).get()
    except Exception as err:  # ValueError (not found) or an API error
        raise ConfigError(
            f"{field}: Prefect Secret block {block_name!r} could not be read ({type(err).__name__}); create it with "
            f"`prefect block create secret` or in the UI"
        ) from None
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{field}: Prefect Secret block {block_name!r} is empty or not a string")
    return value


def secret_env(mapping: dict[str, str], field: str) -> dict[str, str]:
    """{ENV_VAR: value} for {ENV_VAR: secret-block-name}."""
    return {env_name: read_secret_block(block, f"{field}.{env_name}") for env_name, block in mapping.items()}
