"""The one base of every config (RLOOConfig, EvalConfig, PipelineConfig): error type, field helper, strict model,
error formatter and YAML loader, so the three read, fail and report alike."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field, the value and what was expected."""


def F(default: Any, doc: str, **kw: Any) -> Any:
    """A documented field: `doc` says what it means, why the default, and when to change it."""
    return Field(default, description=doc, **kw)


def import_paths(why: str) -> BeforeValidator:
    """A list of `module:function` strings where a Python callable cannot go (a config file, another process): a
    callable is refused in one line saying `why` and what to give instead, not as "Input should be a valid string"."""

    def check(value: Any) -> Any:
        for i, item in enumerate(value if isinstance(value, list) else []):
            if callable(item) and not isinstance(item, str):
                name = f"{getattr(item, '__module__', '?')}:{getattr(item, '__qualname__', type(item).__name__)}"
                raise ValueError(f"[{i}] is the Python callable {name}; {why}")
        return value

    return BeforeValidator(check)


class StrictModel(BaseModel):
    """Unknown keys are errors (a misspelt option never passes silently), and assignments are validated too."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, populate_by_name=True)


Model = TypeVar("Model", bound=BaseModel)

# A validator's message that names its own field first: "model: not set; ...".
_FIELD_FIRST = re.compile(r"([a-z_]+): ")


def format_validation_error(err: ValidationError, source: str) -> str:
    """One line per problem, `<source>: <dotted.field>: <message> (got <value>)`."""
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"])
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown option; check the spelling against docs/configuration.md"
        elif e["type"] == "missing":
            msg = "required option is missing"
        elif e["type"] == "value_error" and loc and (m := _FIELD_FIRST.match(msg)) and m.group(1) != loc.split(".")[-1]:
            # A nested model's validator names its field: judge + "model: not set" -> judge.model: not set.
            loc, msg = f"{loc}.{m.group(1)}", msg[m.end():]
        got = f" (got {e['input']!r})" if e["type"] not in ("missing", "value_error") and "input" in e else ""
        lines.append(f"{source}: {loc}: {msg}{got}" if loc else f"{source}: {msg}")
    return "\n".join(lines)


def validated(model: type[Model], values: dict[str, Any], source: str) -> Model:
    """`values` validated into `model`, or ConfigError naming every bad field (prefixed with `source`)."""
    try:
        return model.model_validate(values)
    except ValidationError as err:
        raise ConfigError(format_validation_error(err, source)) from None


def load_yaml(path: str | Path) -> dict[str, Any]:
    """Reads a YAML mapping, with errors naming the file."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"--config: {p} does not exist or is not a file; expected a YAML config file")
    try:
        data = yaml.load(p.read_text(encoding="utf-8"), Loader=_UniqueKeyLoader) or {}
    except UnicodeDecodeError as err:
        raise ConfigError(f"--config: {p} is not UTF-8 text (byte {err.start} is {err.object[err.start]:#04x}); "
                          "expected a YAML file") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"--config: {p} is not valid YAML: {err}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--config: {p} holds a {type(data).__name__}; expected a mapping of option: value")
    return data


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.safe_load, except that a key given twice in one mapping is an error (PyYAML keeps the last silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            line = key_node.start_mark.line + 1
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} appears twice (lines {seen[key]} and {line}); keep one", key_node.start_mark)
            seen[key] = line
        return super().construct_mapping(node, deep=deep)
