"""Custom `prefect deploy` step: load a PipelineConfig YAML as deployment parameters (validated at deploy time).

Used from deployments/prefect.yaml:

    build:
      - flows.deployment_steps.load_pipeline_config:
          id: example-config
          path: configs/pipeline_example.yaml
    deployments:
      - name: nightly
        parameters:
          cfg: "{{ example-config.cfg }}"

A config that does not validate fails `prefect deploy`, so a broken nightly never gets scheduled.
"""

from __future__ import annotations

from typing import Any

from rloo_engine.pipeline.config import PipelineConfig


def load_pipeline_config(path: str) -> dict[str, Any]:
    """{"cfg": <the config as the flow parameter's JSON>} for `path`."""
    cfg = PipelineConfig.from_yaml(path)
    return {"cfg": cfg.model_dump(mode="json", exclude_defaults=True)}
