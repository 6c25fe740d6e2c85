"""Prefect tasks of the RLHF pipeline, one module per stage. Each is thin: validate its inputs, call the library
(`rloo_engine`, the pipeline's own logic in `rloo_engine.pipeline`), record the result.

Tasks pass paths, digests and MLflow run ids to each other (`rloo_engine.pipeline.stage_results`), never model
objects. Layering: flows -> tasks -> rloo_engine; `rloo_engine` never imports Prefect (tests/test_layering.py).
"""
