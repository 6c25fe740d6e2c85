"""Environment variables handed to one consumer: set for a block (the judge's key during evaluation), or the
environment of a child process minus the secrets meant for others (the training process never sees the judge's key)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def scoped_env(values: dict[str, str]) -> Iterator[None]:
    """Sets environment variables for the duration of the block, then restores what was there."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, old in saved.items():
            if old is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = old


def child_env(base: dict[str, str], withhold: set[str], extra: dict[str, str]) -> dict[str, str]:
    """The environment of a child process: `base` minus the secrets meant for others, plus `extra`."""
    env = {k: v for k, v in base.items() if k not in withhold}
    env.update(extra)
    return env
