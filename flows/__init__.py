"""Prefect flows of the RLHF pipeline: `rlhf_pipeline` (ingest -> reward -> train -> evaluate -> register) and
`evaluate_policy` (evaluation only). They compose `tasks/`; see docs/pipeline.md for deployments."""
