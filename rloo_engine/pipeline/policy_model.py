"""A trained policy checkpoint as an MLflow LoggedModel of the transformers flavor (task `text-generation`).

The checkpoint directory is logged as it is (MLflow's "local checkpoint" path: the files are copied,
the model is never loaded or run), so a registered version holds the exact weights whose digest
the pipeline recorded, and `models:/<name>@<alias>` can be ingested again as `sft.source`. The
LoggedModel's source run is the training run (its final metrics are attached to the model); the
run that registers it records it as an input. Loading it back:

    model = mlflow.pyfunc.load_model("models:/rloo-policy@candidate")
    model.predict(["TL;DR: ..."], params={"max_new_tokens": 64})  # -> list of completions (prompt not repeated)

`mlflow models serve -m models:/rloo-policy@candidate` serves the same predict function.
"""

from __future__ import annotations

import importlib
import logging
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from importlib.metadata import PackageNotFoundError, version

from rloo_engine.services import scoped_env

# Generation options a caller may pass to predict(params=...), with their defaults.
PREDICT_PARAMS = {"max_new_tokens": 128, "do_sample": False, "temperature": 1.0}


def log_policy_model(
    checkpoint_dir: str,
    *,
    tracking_uri: str,
    experiment_id: str,
    train_run_id: str,
    step: int,
    description: str,
    tags: dict[str, str],
) -> str:
    """Logs `checkpoint_dir` as a LoggedModel whose source run is `train_run_id`; returns its `models:/<id>` URI."""
    import mlflow.transformers
    from huggingface_hub import ModelCard
    from mlflow.models import infer_signature

    # Prompts in, completions out; generation options as params. Given explicitly, so saving never runs the model.
    signature = infer_signature(["a prompt"], ["a completion"], params=PREDICT_PARAMS)
    card = ModelCard(f"---\nlicense: other\n---\n# RLOO policy\n\n{description}\n")
    # Model.log resolves the store and experiment from the environment (there is no client argument).
    env = {
        "MLFLOW_TRACKING_URI": tracking_uri,
        "MLFLOW_REGISTRY_URI": tracking_uri,
        "MLFLOW_EXPERIMENT_ID": experiment_id,
        "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false",
    }
    with scoped_env(env), _pinned_mlflow_uris(tracking_uri), _quiet_mlflow_transformers(), \
            _pipeline_classes_for_mlflow():
        info = mlflow.transformers.log_model(
            checkpoint_dir,
            name="policy",
            task="text-generation",
            run_id=train_run_id,
            step=step,
            signature=signature,
            # Completions only, as the judge and the engine see them; greedy unless params say otherwise.
            model_config={"return_full_text": False},
            model_card=card,
            pip_requirements=_requirements(),
            tags={**tags, "mlflow.note.content": description},  # the model page's description
        )
    return info.model_uri


@contextmanager
def _pinned_mlflow_uris(uri: str) -> Iterator[None]:
    """MLflow's process-wide tracking and registry URIs, pinned to `uri` for the call.

    `Model.log` prefers a URI set earlier with `mlflow.set_tracking_uri` (by anyone in the process,
    e.g. a library or an earlier run) over the environment, and would log to that store instead.
    """
    from mlflow.tracking._model_registry import utils as registry_utils
    from mlflow.tracking._tracking_service import utils as tracking_utils

    saved = tracking_utils._tracking_uri, registry_utils._registry_uri
    tracking_utils._tracking_uri, registry_utils._registry_uri = uri, uri
    try:
        yield
    finally:
        tracking_utils._tracking_uri, registry_utils._registry_uri = saved


@contextmanager
def _pipeline_classes_for_mlflow() -> Iterator[None]:
    """MLflow 3.17 reads `transformers.pipelines.check_task(task)[1]["impl"].__name__` when logging a checkpoint
    directory; transformers 5 lists `impl` as a dotted string. Resolves it to the class for the duration of the call."""
    from transformers import pipelines

    original = pipelines.check_task

    def check_task(task):
        name, meta, options = original(task)
        impl = meta.get("impl")
        if isinstance(impl, str):
            module, _, cls = impl.rpartition(".")
            meta = {**meta, "impl": getattr(importlib.import_module(module), cls)}
        return name, meta, options

    pipelines.check_task = check_task
    try:
        yield
    finally:
        pipelines.check_task = original


@contextmanager
def _quiet_mlflow_transformers() -> Iterator[None]:
    """The flavor warns about a missing license (ours says `other`: it is the SFT model's) and version ranges."""
    logger = logging.getLogger("mlflow.transformers")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            yield
    finally:
        logger.setLevel(level)


def _requirements() -> list[str]:
    reqs = ["mlflow"]
    for package in ("torch", "transformers", "accelerate"):
        try:
            reqs.append(f"{package}>={version(package).split('+')[0]}")
        except PackageNotFoundError:
            reqs.append(package)
    return reqs
