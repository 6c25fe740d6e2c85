"""The environment these tests give vLLM: the one a user's install has, captured before anything runs.

vLLM's colocate engine (`distributed_executor_backend="external_launcher"`) sets VLLM_ENABLE_V1_MULTIPROCESSING=0 in
its own process when it is built; a training or server subprocess started after that must not inherit it, or it
would run vLLM in a layout a user's does not. Subprocesses take `user_environment()`.
"""

from __future__ import annotations

import os

# Variables that move vLLM's engine or change its code path; a user's install sets none of them.
LAYOUT_VARIABLES = ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_WORKER_MULTIPROC_METHOD", "VLLM_USE_V1")

AT_START = dict(os.environ)


def user_environment(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in AT_START.items() if k not in LAYOUT_VARIABLES}
    return {**env, **extra}
