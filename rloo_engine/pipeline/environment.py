"""The environment of a child process minus the secrets meant for others (the training process never sees the judge's
key). Setting variables for a block is `rloo_engine.services.scoped_env`."""

from __future__ import annotations


def child_env(base: dict[str, str], withhold: set[str], extra: dict[str, str]) -> dict[str, str]:
    """The environment of a child process: `base` minus the secrets meant for others, plus `extra`."""
    env = {k: v for k, v in base.items() if k not in withhold}
    env.update(extra)
    return env
