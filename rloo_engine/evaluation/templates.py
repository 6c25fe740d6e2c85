"""Judge prompt templates: versioned YAML files (built-in or user-supplied), rendered into chat messages.

A template file has `name`, `version`, `user` (with the placeholders `{prompt}`, `{answer_a}` and
`{answer_b}`), and optionally `system`, `reask` (the follow-up sent once when the verdict does not
parse) and `verdict_prefix` (the label of the final line, default `Preferred`). The template hash
covers everything that changes what the judge is asked, so editing a template invalidates the cache.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import yaml

from rloo_engine.config_base import ConfigError

BUILTIN_DIR = Path(__file__).parent / "templates"
BUILTIN = {"tldr": "tldr_v1.yaml", "helpfulness": "helpfulness_v1.yaml"}
PLACEHOLDERS = ("prompt", "answer_a", "answer_b")
_PLACEHOLDER_RE = re.compile(r"\{(prompt|answer_a|answer_b)\}")
DEFAULT_REASK = (
    "Your reply did not end with the verdict line. Reply with one line only: `{prefix}: A` or `{prefix}: B`."
)


@dataclass(frozen=True)
class JudgeTemplate:
    name: str
    version: str
    user: str
    system: str | None = None
    reask: str | None = None
    verdict_prefix: str = "Preferred"
    source: str = ""

    @cached_property  # the template is frozen; the judge reads this once per judgment
    def hash(self) -> str:
        """First 16 hex digits of the SHA-256 of the parts that reach the judge."""
        parts = {"system": self.system, "user": self.user, "reask": self.reask_text, "prefix": self.verdict_prefix}
        return hashlib.sha256(json.dumps(parts, sort_keys=True).encode("utf-8")).hexdigest()[:16]

    @property
    def reask_text(self) -> str:
        return self.reask or DEFAULT_REASK.format(prefix=self.verdict_prefix)

    def render(self, prompt: str, answer_a: str, answer_b: str) -> list[dict[str, str]]:
        """Chat messages asking the judge to compare `answer_a` (slot A) and `answer_b` (slot B)."""
        values = {"prompt": prompt, "answer_a": answer_a, "answer_b": answer_b}
        # Substituted part by part, so placeholder-like text inside the values is left alone.
        user = "".join(values.get(part, part) if i % 2 else part for i, part in enumerate(self._user_parts))
        messages = [{"role": "system", "content": self.system}] if self.system else []
        return messages + [{"role": "user", "content": user}]

    @cached_property
    def _user_parts(self) -> list[str]:
        """`user` split at its placeholders: literal text at even indices, placeholder names at odd ones."""
        return _PLACEHOLDER_RE.split(self.user)

    def info(self) -> dict[str, str]:
        return {"name": self.name, "version": self.version, "hash": self.hash, "source": self.source}


def load_template(name_or_path: str) -> JudgeTemplate:
    """A built-in template by name (`tldr`, `helpfulness`) or a template YAML file by path."""
    if name_or_path in BUILTIN:
        path = BUILTIN_DIR / BUILTIN[name_or_path]
        source = f"builtin:{name_or_path}"
    else:
        path = Path(name_or_path)
        source = str(path)
        if not path.is_file():
            raise ConfigError(
                f"judge.template: {name_or_path!r} is neither a built-in template ({', '.join(BUILTIN)}) nor a file"
            )
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as err:
        raise ConfigError(f"judge.template: {path} is not valid YAML: {err}") from None
    if not isinstance(data, dict):
        raise ConfigError(
            f"judge.template: {path} holds a {type(data).__name__}; expected a mapping with a `user` field"
        )
    unknown = set(data) - {"name", "version", "system", "user", "reask", "verdict_prefix"}
    if unknown:
        raise ConfigError(f"judge.template: {path} has unknown fields {sorted(unknown)}")
    user = data.get("user")
    if not isinstance(user, str) or not user.strip():
        raise ConfigError(f"judge.template: {path} has no `user` text")
    missing = [p for p in PLACEHOLDERS if "{" + p + "}" not in user]
    if missing:
        raise ConfigError(
            f"judge.template: {path} `user` text lacks {', '.join('{' + m + '}' for m in missing)}; "
            "it needs {prompt}, {answer_a} and {answer_b}"
        )
    prefix = str(data.get("verdict_prefix") or "Preferred")
    return JudgeTemplate(
        name=str(data.get("name") or path.stem),
        version=str(data.get("version", "1")),
        user=user,
        system=data.get("system") or None,
        reask=data.get("reask") or None,
        verdict_prefix=prefix,
        source=source,
    )
