"""Renders a pydantic config class as a Markdown reference table (used to generate docs/configuration.md)."""

from __future__ import annotations

import json
import typing

from pydantic import BaseModel
from pydantic_core import PydanticUndefined


def _type_name(annotation) -> str:
    text = getattr(annotation, "__name__", None) if typing.get_origin(annotation) is None else None
    return text or str(annotation).replace("typing.", "")


def _default(field) -> str:
    if field.default is PydanticUndefined and field.default_factory is None:
        return "**required**"
    value = field.default_factory() if field.default_factory is not None else field.default
    if isinstance(value, BaseModel):
        return "(section)"
    return f"`{json.dumps(value, default=str)}`"


def markdown_table(model: type[BaseModel], prefix: str = "") -> str:
    """One row per field (nested config sections are expanded with a dotted prefix)."""
    rows, nested = [], []
    for name, field in model.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            nested.append((f"{prefix}{name}.", annotation))
            continue
        doc = (field.description or "").replace("|", "\\|").replace("\n", " ")
        type_name = _type_name(annotation).replace("|", "\\|")
        rows.append(f"| `{prefix}{name}` | `{type_name}` | {_default(field)} | {doc} |")
    table = "| option | type | default | meaning |\n|---|---|---|---|\n" + "\n".join(rows) + "\n"
    for sub_prefix, sub in nested:
        table += f"\n#### `{sub_prefix.rstrip('.')}`\n\n" + markdown_table(sub, sub_prefix)
    return table
