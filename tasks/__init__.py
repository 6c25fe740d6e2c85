"""Prefect tasks of the RLHF pipeline. Each is thin: validate its inputs, call `rloo_engine`, record the result.

Tasks pass paths, digests and MLflow run ids to each other, never model objects. Layering:
flows -> tasks -> rloo_engine; `rloo_engine` never imports Prefect.
"""

from tasks.config import PipelineConfig, build_pipeline_config

__all__ = ["PipelineConfig", "build_pipeline_config"]
