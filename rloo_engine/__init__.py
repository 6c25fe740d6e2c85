"""rloo_engine: RLOO training and LLM-judge evaluation for language models (no Prefect imports).

`from rloo_engine import RLOOConfig, RLOOTrainer` is TRL's Python API (`trl.RLOOConfig`, `trl.RLOOTrainer`); both
are imported on first use, so `import rloo_engine` stays light (the command line, the pipeline's tasks).
"""

from importlib.metadata import PackageNotFoundError, version
from typing import Any

try:
    __version__ = version("rloo-pipeline")
except PackageNotFoundError:  # a checkout on PYTHONPATH, not installed
    __version__ = "unknown"

__all__ = ["RLOOConfig", "RLOOTrainer", "__version__"]


def __getattr__(name: str) -> Any:
    if name == "RLOOConfig":
        from rloo_engine.config import RLOOConfig

        return RLOOConfig
    if name == "RLOOTrainer":
        from rloo_engine.trainer import RLOOTrainer

        return RLOOTrainer
    raise AttributeError(f"module 'rloo_engine' has no attribute {name!r}")
