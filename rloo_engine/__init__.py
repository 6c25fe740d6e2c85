"""rloo_engine: RLOO training and LLM-judge evaluation for language models (no Prefect imports)."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("rloo-pipeline")
except PackageNotFoundError:  # a checkout on PYTHONPATH, not installed
    __version__ = "unknown"
