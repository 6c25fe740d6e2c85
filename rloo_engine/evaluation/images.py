"""Images of eval prompts: a row's `image` (one) or `images` (a list) as references, checked where they are loaded.

A reference names an image in prompt ids, completion fingerprints and judge cache keys: the resolved path of an
image file (a relative path is resolved against the prompt file's directory when the prompts are a local file,
else against the working directory), or `sha256:<16 hex>` of the content of an image given as data (bytes, the
`{"bytes", "path"}` dict `datasets.Image` stores, a PIL image of a hub dataset). Every image is opened when the
prompts load, so a missing or broken file fails before any model loads, naming the row.
"""

from __future__ import annotations

import hashlib
import io
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rloo_engine.config_base import ConfigError
from rloo_engine.vision import image_items, row_images


@dataclass(frozen=True)
class PromptImages:
    references: tuple[str, ...]
    sources: tuple[Any, ...]  # what `vision.row_images` opens again for generation: paths, {"bytes"} dicts, PIL images


def load_row_images(row: dict[str, Any], base_dir: Path | None, where: str) -> PromptImages:
    """The row's images as references and sources, each one opened once here; `where` names the row in errors."""
    sources = [_source(item, base_dir, where) for item in image_items(row)]
    row_images({"images": sources}, where)  # a file that is not an image, or an unknown type, fails now
    return PromptImages(tuple(_reference(s) for s in sources), tuple(sources))


def open_images(sources: Iterable[Any], where: str) -> list:
    """The PIL images (RGB) of `sources`, as `load_row_images` gave them."""
    return row_images({"images": list(sources)}, where)


def images_fingerprint(references: Iterable[str]) -> str:
    """A short hash of image references and, for files, their sizes and modification times: an image overwritten
    in place gets new completions, as `hf_models.weights_fingerprint` does for a checkpoint."""
    digest = hashlib.sha256()
    for reference in references:
        digest.update(reference.encode("utf-8", "surrogatepass"))
        path = Path(reference)
        if not reference.startswith("sha256:") and path.is_file():
            st = path.stat()
            digest.update(f":{st.st_size}:{st.st_mtime_ns}".encode())
        digest.update(b";")
    return digest.hexdigest()[:16]


def _source(item: Any, base_dir: Path | None, where: str) -> Any:
    """A path resolved (and checked to exist), data as a `{"bytes"}` dict, anything else as it is."""
    if isinstance(item, dict) and not item.get("bytes") and item.get("path"):
        item = item["path"]  # datasets.Image(decode=False) of a file
    if isinstance(item, (str, Path)):
        return str(_resolved(Path(item), base_dir, where))
    if isinstance(item, (bytes, bytearray)):
        return {"bytes": bytes(item), "path": None}
    if isinstance(item, io.BytesIO):  # read once here: a buffer's position would move each time it is opened
        return {"bytes": item.getvalue(), "path": None}
    return item


def _resolved(path: Path, base_dir: Path | None, where: str) -> Path:
    base = base_dir if base_dir is not None else Path.cwd()
    resolved = (path if path.is_absolute() else base / path).resolve()
    if not resolved.is_file():
        raise ConfigError(
            f"{where}: image {str(path)!r} is not a file ({resolved}); expected an image file path, a relative one "
            f"being resolved against {base}"
        )
    return resolved


def _reference(source: Any) -> str:
    if isinstance(source, str):
        return source
    if isinstance(source, dict):
        return _content_reference(source["bytes"])
    # a PIL image (row_images refused every other type): its pixels, with the mode and size that shape them
    return _content_reference(f"{source.mode}:{source.size}:".encode() + source.tobytes())


def _content_reference(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()[:16]
