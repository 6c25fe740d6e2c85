"""Checkpoint sources (local dir, hub id, MLflow URI), content digests, and load checks without loading weights.

`inspect_checkpoint` proves that config, tokenizer and weights fit together while never holding
the weights in RAM: the model is built on the meta device (shapes only) and compared against the
safetensors headers (names, shapes, dtypes), which are read without reading the tensors.
No Prefect here; `tasks/ingest.py` wraps these in tasks.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from collections import Counter
from pathlib import Path
from typing import Literal

from pydantic import BaseModel

from rloo_engine.config_base import ConfigError
from rloo_engine.run.preflight import check_tokenizer_saved
from rloo_engine.vision import is_vision_language

Kind = Literal["causal_lm", "reward_model"]
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin")


class CheckpointFacts(BaseModel):
    """What a checkpoint is, independent of where it lives (so it can be cached on the digest)."""

    kind: Kind
    architecture: str
    model_type: str
    num_parameters: int
    dtype: str
    weight_bytes: int
    weight_files: list[str]
    vocab_size: int | None
    tokenizer_class: str
    pad_token: str | None
    eos_token: str | None
    has_chat_template: bool
    num_labels: int | None = None
    vision_language: bool = False  # loads with AutoModelForImageTextToText; its processor loaded too


class CheckpointInfo(BaseModel):
    """An ingested checkpoint: where it came from, where it is on this machine, its digest and facts."""

    source: str
    source_kind: Literal["local", "hub", "mlflow"]
    local_path: str
    digest: str
    facts: CheckpointFacts

    def summary(self) -> dict[str, str | int | bool | None]:
        f = self.facts
        return {
            "source": self.source,
            "source_kind": self.source_kind,
            "local_path": self.local_path,
            "digest": self.digest,
            "architecture": f.architecture,
            "model_type": f.model_type,
            "num_parameters": f.num_parameters,
            "dtype": f.dtype,
            "weight_bytes": f.weight_bytes,
            "tokenizer_class": f.tokenizer_class,
            "pad_token": f.pad_token,
            "eos_token": f.eos_token,
            "has_chat_template": f.has_chat_template,
            "num_labels": f.num_labels,
        }


# ---------------------------------------------------------------- sources


def source_kind(source: str) -> Literal["local", "hub", "mlflow"]:
    """`models:/...` and `runs:/...` are MLflow; an existing path is local; `owner/name` is a hub id."""
    if source.startswith(("models:/", "runs:/")):
        return "mlflow"
    if Path(source).expanduser().exists():
        return "local"
    if source.startswith(("/", ".", "~")) or not _HUB_ID.match(source):
        return "local"  # meant as a path; materialize_source reports that it does not exist
    return "hub"


def materialize_source(
    source: str, field: str, download_dir: Path, revision: str | None = None, tracking_uri: str | None = None
) -> tuple[Path, Literal["local", "hub", "mlflow"]]:
    """A local directory holding the checkpoint: the path itself, the hub snapshot, or a download of the MLflow model
    into `download_dir`."""
    kind = source_kind(source)
    if kind == "local":
        path = Path(source).expanduser()
        if not path.exists():
            raise ConfigError(
                f"{field}: {source} does not exist; expected a checkpoint directory, a hub id (owner/name) or an "
                "MLflow model URI (models:/name@alias, runs:/<run_id>/path)"
            )
        if not path.is_dir():
            raise ConfigError(f"{field}: {source} is a file; expected a checkpoint directory (config.json + weights)")
        return path.resolve(), kind
    if kind == "hub":
        return _download_hub(source, field, revision), kind
    return _download_mlflow(source, field, download_dir, tracking_uri), kind


def _download_hub(repo_id: str, field: str, revision: str | None) -> Path:
    """The hub snapshot in the shared Hugging Face cache (downloaded once per node, not once per run)."""
    from huggingface_hub import snapshot_download

    try:
        return Path(
            snapshot_download(
                repo_id,
                revision=revision,
                allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"],
            )
        )
    except Exception as err:
        raise ConfigError(
            f"{field}: {repo_id!r} is not a local path, and downloading it as a hub model failed: "
            f"{type(err).__name__}: {err}"
        ) from err


def _download_mlflow(uri: str, field: str, dest: Path, tracking_uri: str | None) -> Path:
    import mlflow.artifacts
    from mlflow.tracking import MlflowClient

    if tracking_uri is None:
        raise ConfigError(f"{field}: {uri} is an MLflow URI, but no MLflow tracking URI is configured")
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    try:
        artifact_uri = uri
        if uri.startswith("models:/"):
            # Resolved here with an explicit registry: MLflow's models:/ download path ignores the
            # registry_uri argument and would consult the process-global default (a local mlflow.db).
            client = MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)
            name, version = _model_version(client, uri.removeprefix("models:/"))
            artifact_uri = client.get_model_version_download_uri(name, version)
        root = Path(
            mlflow.artifacts.download_artifacts(
                artifact_uri=artifact_uri, dst_path=str(dest), tracking_uri=tracking_uri
            )
        )
    except ConfigError:
        raise
    except Exception as err:
        raise ConfigError(f"{field}: cannot download MLflow model {uri!r}: {type(err).__name__}: {err}") from err
    return find_hf_checkpoint(root, field, uri)


def _model_version(client, ref: str) -> tuple[str, str]:
    """`name@alias`, `name/<version>` or `name/latest` -> (name, version)."""
    if "@" in ref:
        name, alias = ref.split("@", 1)
        return name, client.get_model_version_by_alias(name, alias).version
    name, _, version = ref.partition("/")
    if version in ("", "latest"):
        versions = client.search_model_versions(f"name = '{name}'", order_by=["version_number DESC"], max_results=1)
        if not versions:
            raise ConfigError(f"models:/{ref}: registered model {name!r} has no versions")
        return name, versions[0].version
    return name, version


def find_hf_checkpoint(root: Path, field: str, source: str) -> Path:
    """The shallowest directory under `root` with a config.json and weights (MLflow models nest them)."""
    candidates = sorted(
        (p.parent for p in root.rglob("config.json") if weight_files(p.parent)), key=lambda p: len(p.parts)
    )
    if not candidates:
        raise ConfigError(f"{field}: {source} holds no directory with config.json and weight files")
    return candidates[0]


# ---------------------------------------------------------------- digest


def weight_files(directory: Path) -> list[Path]:
    found: set[Path] = set()
    for pattern in WEIGHT_PATTERNS:
        found.update(p for p in directory.glob(pattern) if p.is_file())
    return sorted(found)


def content_digest(directory: Path) -> str:
    """sha256 over the weight files' names and bytes: equal weights, equal digest, wherever they are stored."""
    total = hashlib.sha256()
    for path in weight_files(directory):
        file_hash = hashlib.sha256()
        with path.open("rb") as fh:
            for block in iter(lambda: fh.read(1 << 22), b""):
                file_hash.update(block)
        total.update(f"{path.name}\0{file_hash.hexdigest()}\n".encode())
    return "sha256:" + total.hexdigest()


# ---------------------------------------------------------------- inspection


def tensor_headers(directory: Path, field: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """{tensor name: (shape, dtype)} from the weight files, without reading tensor data."""
    headers: dict[str, tuple[tuple[int, ...], str]] = {}
    for path in weight_files(directory):
        if path.suffix == ".safetensors":
            headers.update(_safetensors_header(path, field))
        else:
            import torch

            # mmap: pages are mapped, not read, so even a large .bin is not materialised in RAM.
            state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
            headers.update({k: (tuple(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in state.items()})
    return headers


_SAFETENSORS_DTYPES = {
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "F64": "float64",
    "I64": "int64",
    "I32": "int32",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
}


def _safetensors_header(path: Path, field: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """Parses the JSON header at the start of a .safetensors file (8-byte length, then the header)."""
    try:
        with path.open("rb") as fh:
            size = int.from_bytes(fh.read(8), "little")
            if not 0 < size < 100_000_000:
                raise ValueError(f"header length {size} is implausible")
            header = json.loads(fh.read(size))
    except (OSError, ValueError) as err:
        raise ConfigError(f"{field}: {path} is not a valid safetensors file: {err}") from err
    header.pop("__metadata__", None)
    return {k: (tuple(v["shape"]), _SAFETENSORS_DTYPES.get(v["dtype"], v["dtype"])) for k, v in header.items()}


def inspect_checkpoint(directory: Path, kind: Kind, field: str) -> CheckpointFacts:
    """Checks that config, tokenizer and weights load together, building the model on the meta device only."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    where = f"{field}: {directory}"
    if (directory / "adapter_config.json").is_file() and not (directory / "config.json").is_file():
        raise ConfigError(f"{where} holds a LoRA adapter only; merge it into its base model first")
    try:
        config = AutoConfig.from_pretrained(directory)
    except Exception as err:
        raise ConfigError(f"{where}: config.json does not load: {type(err).__name__}: {err}") from err
    check_tokenizer_saved(field, str(directory))  # else transformers 5 returns an empty tokenizer
    try:
        tokenizer = AutoTokenizer.from_pretrained(directory)
    except Exception as err:
        raise ConfigError(f"{where}: tokenizer does not load: {type(err).__name__}: {err}") from err
    if not weight_files(directory):
        raise ConfigError(f"{where} has no weight files (*.safetensors or pytorch_model*.bin)")
    headers = tensor_headers(directory, field)

    vision = kind == "causal_lm" and is_vision_language(config)
    auto = AutoModelForCausalLM if kind == "causal_lm" else AutoModelForSequenceClassification
    if vision:  # a vision-language policy: its processor must load, as the trainer loads it
        from transformers import AutoModelForImageTextToText, AutoProcessor

        auto = AutoModelForImageTextToText
        try:
            AutoProcessor.from_pretrained(directory)
        except Exception as err:
            raise ConfigError(f"{where}: a vision-language model ({config.model_type}) whose processor does not "
                              f"load: {type(err).__name__}: {err}") from err
    try:
        with torch.device("meta"):
            model = auto.from_config(config)
    except Exception as err:
        raise ConfigError(
            f"{where}: cannot build a {auto.__name__} from its config: {type(err).__name__}: {err}"
        ) from err
    if vision:
        _check_weights_size(model, headers, where)
    else:
        _check_weights_match(model, config, headers, where)

    num_labels = getattr(config, "num_labels", None) if kind == "reward_model" else None
    dtypes = Counter(dtype for _, dtype in headers.values())
    return CheckpointFacts(
        kind=kind,
        architecture=(config.architectures or [type(model).__name__])[0],
        model_type=config.model_type,
        num_parameters=sum(_numel(shape) for shape, _ in headers.values()),
        dtype=dtypes.most_common(1)[0][0],
        weight_bytes=sum(p.stat().st_size for p in weight_files(directory)),
        weight_files=[p.name for p in weight_files(directory)],
        vocab_size=getattr(config.get_text_config(), "vocab_size", None),
        tokenizer_class=type(tokenizer).__name__,
        pad_token=tokenizer.pad_token,
        eos_token=tokenizer.eos_token,
        has_chat_template=bool(getattr(tokenizer, "chat_template", None)),
        num_labels=num_labels,
        vision_language=vision,
    )


def _check_weights_match(model, config, headers: dict[str, tuple[tuple[int, ...], str]], where: str) -> None:
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    prefix = f"{model.base_model_prefix}."
    if prefix != "." and not set(headers) & set(expected):
        # Checkpoints of the bare base model (e.g. saved from AutoModel) lack the head's prefix.
        headers = {prefix + k: v for k, v in headers.items()}
    tied = (
        set(getattr(model, "_tied_weights_keys", None) or ())
        if getattr(config, "tie_word_embeddings", False)
        else set()
    )
    missing = sorted(k for k in expected if k not in headers and k not in tied)
    unexpected = sorted(k for k in headers if k not in expected and not _BENIGN_EXTRA.search(k))
    mismatched = [
        f"{k} {headers[k][0]} != {expected[k]}" for k in expected if k in headers and headers[k][0] != expected[k]
    ]
    if missing:
        raise ConfigError(f"{where}: weights lack {len(missing)} tensors of the model, e.g. {missing[:3]}")
    if unexpected:
        raise ConfigError(
            f"{where}: weights hold {len(unexpected)} tensors a {type(model).__name__} does not have, e.g. "
            f"{unexpected[:3]}; is this the right kind of checkpoint?"
        )
    if mismatched:
        raise ConfigError(f"{where}: weight shapes do not match the config: {mismatched[:3]}")


def _check_weights_size(model, headers: dict[str, tuple[tuple[int, ...], str]], where: str) -> None:
    """A vision-language checkpoint's weights hold as many elements as its config's model. Names are not compared:
    transformers saves these models under their original layout (`language_model.model.*`) and renames the keys as
    it loads them (its conversion mapping, internal and release-specific)."""
    model.tie_weights()  # from_config leaves a tied head a parameter of its own; from_pretrained ties it
    names = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    buffers = [v for k, v in model.state_dict().items() if k not in names]  # persistent buffers
    expected = sum(p.numel() for p in model.parameters()) + sum(b.numel() for b in buffers)  # tied weights once
    held = sum(_numel(shape) for name, (shape, _) in headers.items() if not _BENIGN_EXTRA.search(name))
    if held != expected:
        raise ConfigError(f"{where}: weights hold {held:,} elements and a {type(model).__name__} of its config has "
                          f"{expected:,}; is this the right checkpoint for its config?")


# Buffers some older checkpoints saved that current models recompute; harmless when present.
_BENIGN_EXTRA = re.compile(r"rotary_emb\.inv_freq$|\.masked_bias$|\.attn\.bias$")


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
