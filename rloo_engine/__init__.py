"""rloo_engine: RLOO training and LLM-judge evaluation for language models (no Prefect imports)."""

__version__ = "0.1.0"
