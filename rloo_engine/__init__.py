"""rloo_engine: RLOO training and LLM-judge evaluation for language models (no Prefect imports).

`from rloo_engine import RLOOConfig, RLOOTrainer` is TRL's Python API (`trl.RLOOConfig`, `trl.RLOOTrainer`); both
are imported on first use, so `import rloo_engine` stays light (the command line, the pipeline's tasks).
"""

import logging
from importlib.metadata import PackageNotFoundError, version
from typing import Any

try:
    __version__ = version("rloo-pipeline")
except PackageNotFoundError:  # a checkout on PYTHONPATH, not installed
    __version__ = "unknown"

__all__ = ["RLOOConfig", "RLOOTrainer", "__version__"]


class _NoDeepSpeedCpuGuess(logging.Filter):
    """transformers imports DeepSpeed whenever it is installed, and on a machine without CUDA DeepSpeed then warns
    `Setting accelerator to CPU. If you have GPU ...` once per process: on every command and in every training
    log, about a machine the run already knows has no GPU. Only that line is dropped; DeepSpeed still picks its
    accelerator itself (the same CPU one), and its other messages pass."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Setting accelerator to CPU")


logging.getLogger("DeepSpeed").addFilter(_NoDeepSpeedCpuGuess())


def __getattr__(name: str) -> Any:
    if name == "RLOOConfig":
        from rloo_engine.config import RLOOConfig

        return RLOOConfig
    if name == "RLOOTrainer":
        from rloo_engine.trainer import RLOOTrainer

        return RLOOTrainer
    raise AttributeError(f"module 'rloo_engine' has no attribute {name!r}")
