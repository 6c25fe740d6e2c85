"""The training and evaluation prompt sets as MLflow dataset inputs (name, digest, source, row count) of the runs that use them.

MLflow's runs table shows them in its Datasets column, so runs trained or judged on different data
tell apart at a glance; the digest changes with the content, not the file name. Both sets go on the
parent run when the flow run opens (so even a run that fails early says what it was given), the
training set on the `train` run and the eval set on the `evaluate` run once those exist.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE
from pydantic import BaseModel

from rloo_engine.pipeline import tracking
from rloo_engine.pipeline.config import DataSection
from rloo_engine.pipeline.tracking import RunRef

CONTEXT_TAG = "mlflow.data.context"  # what the UI shows next to the dataset's name


class PromptSet(BaseModel):
    """An MLflow dataset entity, as plain fields so it can pass between tasks."""

    name: str
    digest: str
    source_type: str
    source: str
    columns_schema: str | None
    profile: str | None
    context: str

    def entity(self):
        from mlflow.entities import Dataset

        return Dataset(self.name, self.digest, self.source_type, self.source, self.columns_schema, self.profile)


class PromptSets(BaseModel):
    train: PromptSet | None
    eval: PromptSet


@task(name="record_prompt_sets", cache_policy=NO_CACHE)
def record_prompt_sets(data: DataSection, parent: RunRef, with_training: bool = True) -> PromptSets:
    """Reads the prompt sets once, logs them as inputs of the parent run and returns them for the stage runs."""
    from rloo_engine.data import load_prompt_dataset
    from rloo_engine.evaluation.data import load_prompts

    train = None
    if with_training:
        rows = list(load_prompt_dataset(data.train_prompts, data.train_config, data.train_split))
        train = prompt_set(rows, data.train_prompts, "train_prompts", "training", data.train_config, data.train_split)
    eval_rows = [
        {"prompt": p.prompt, "reference": p.reference}
        for p in load_prompts(
            data.eval_prompts,
            split=data.eval_split,
            prompt_column=data.prompt_column,
            reference_column=data.reference_column,
        )
    ]
    sets = PromptSets(
        train=train, eval=prompt_set(eval_rows, data.eval_prompts, "eval_prompts", "evaluation", None, data.eval_split)
    )
    log_prompt_sets(parent, *(s for s in (sets.train, sets.eval) if s))
    return sets


def prompt_set(
    rows: list[dict[str, Any]], source: str, name: str, context: str, config: str | None, split: str
) -> PromptSet:
    """The MLflow dataset of `rows`: digest over the content, source the file/directory or the hub dataset."""
    import mlflow.data
    import pandas as pd
    from mlflow.data.huggingface_dataset_source import HuggingFaceDatasetSource

    # Conversational prompts are lists of messages; as JSON text they hash and display like any column.
    frame = pd.DataFrame([{k: _cell(v) for k, v in row.items()} for row in rows])
    path = Path(source).expanduser()
    origin: Any = (
        str(path.resolve()) if path.exists() else HuggingFaceDatasetSource(path=source, config_name=config, split=split)
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*can be interpreted in multiple ways.*")
        entity = mlflow.data.from_pandas(frame, source=origin, name=name)._to_mlflow_entity()
    return PromptSet(
        name=entity.name,
        digest=entity.digest,
        source_type=entity.source_type,
        source=entity.source,
        columns_schema=entity.schema,
        profile=entity.profile,
        context=context,
    )


def log_prompt_sets(run: RunRef, *sets: PromptSet) -> None:
    """Logs `sets` as dataset inputs of `run` (a finished stage run accepts inputs too)."""
    from mlflow.entities import DatasetInput, InputTag

    inputs = [DatasetInput(s.entity(), tags=[InputTag(CONTEXT_TAG, s.context)]) for s in sets]
    tracking.client(run.tracking_uri).log_inputs(run.run_id, datasets=inputs)


def log_stage_input(parent: RunRef, stage_run_id: str, prompt_set: PromptSet | None) -> None:
    """The prompt set as an input of a stage run of `parent` (the `train` or `evaluate` run)."""
    if prompt_set is not None:
        log_prompt_sets(parent.model_copy(update={"run_id": stage_run_id}), prompt_set)


def _cell(value: Any) -> Any:
    return json.dumps(value) if isinstance(value, (list, dict)) else value
