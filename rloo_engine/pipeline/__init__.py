"""The pipeline's Prefect-free logic: its config, input-checkpoint inspection, MLflow bookkeeping, the training
launcher and the summaries. The `@task`s in `tasks/` validate, call these and record; nothing here imports Prefect
(tests/test_layering.py), so all of it runs and is tested without a Prefect server."""
