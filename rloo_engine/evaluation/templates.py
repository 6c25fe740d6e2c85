"""Judge prompt templates: versioned YAML files (built-in or user-supplied), rendered into chat messages.

A template file has `name`, `version`, `user` (with the placeholders `{prompt}`, `{answer_a}` and
`{answer_b}`, and optionally `{reference}`: the prompt's gold answer, for reference-guided judging), and
optionally `system`, `reask` (the follow-up sent once when the verdict does not parse), `verdict_prefix`
(the label of the final line, default `Preferred`) and `reply_format` (`verdict_line`, the default, or
`letter`: the judge answers with the single letter A or B, for `judge.verdict: logprobs`). The template
hash covers everything that changes what the judge is asked, so editing a template invalidates the cache;
the reference text is part of each judgment's cache key, as the answers are.
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
BUILTIN = {
    "tldr": "tldr_v1.yaml",
    "helpfulness": "helpfulness_v1.yaml",
    "tldr_letter": "tldr_letter_v1.yaml",
    "helpfulness_letter": "helpfulness_letter_v1.yaml",
    "math_reference": "math_reference_v1.yaml",
}
PLACEHOLDERS = ("prompt", "answer_a", "answer_b")  # required; `{reference}` is optional
REPLY_FORMATS = ("verdict_line", "letter")
_PLACEHOLDER_RE = re.compile(r"\{(prompt|answer_a|answer_b|reference)\}")
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
    reply_format: str = "verdict_line"  # what the judge is asked to answer with; one of REPLY_FORMATS
    source: str = ""

    @cached_property  # the template is frozen; the judge reads this once per judgment
    def hash(self) -> str:
        """First 16 hex digits of the SHA-256 of the parts that reach the judge."""
        parts = {"system": self.system, "user": self.user, "reask": self.reask_text, "prefix": self.verdict_prefix}
        return hashlib.sha256(json.dumps(parts, sort_keys=True).encode("utf-8")).hexdigest()[:16]

    @property
    def reask_text(self) -> str:
        return self.reask or DEFAULT_REASK.format(prefix=self.verdict_prefix)

    @property
    def needs_reference(self) -> bool:
        """Whether the `user` text shows the prompt's gold answer (`{reference}`)."""
        return "reference" in self._user_parts[1::2]

    def render(
        self, prompt: str, answer_a: str, answer_b: str, reference: str | None = None
    ) -> list[dict[str, str]]:
        """Chat messages asking the judge to compare `answer_a` (slot A) and `answer_b` (slot B), against
        `reference` when the template shows one."""
        if self.needs_reference and reference is None:
            raise ValueError(f"template {self.name!r} shows a reference answer ({{reference}}) and none was given")
        values = {"prompt": prompt, "answer_a": answer_a, "answer_b": answer_b, "reference": reference or ""}
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


def check_template_name(name_or_path: str) -> None:
    """Raises ConfigError, at config validation, for a value that is no built-in name and cannot be a template file:
    no path separator, no .yaml suffix, no such file (a typo of a built-in name, or a file name from another
    project's docs, such as `tldr_v1`), instead of at the evaluation's first judgment."""
    path = Path(name_or_path)
    if name_or_path in BUILTIN or path.suffix in (".yaml", ".yml") or "/" in name_or_path or path.is_file():
        return
    raise _unknown_template(name_or_path)


def _unknown_template(name_or_path: str) -> ConfigError:
    versioned = [name for name, file in BUILTIN.items() if Path(file).stem == name_or_path]
    hint = f"; the built-in `{versioned[0]}` is that file (name it without the version)" if versioned else ""
    return ConfigError(
        f"judge.template: {name_or_path!r} is neither a built-in template ({', '.join(BUILTIN)}) nor a template "
        f"YAML file{hint}"
    )


def load_template(name_or_path: str) -> JudgeTemplate:
    """A built-in template by name (`tldr`, `helpfulness`) or a template YAML file by path."""
    if name_or_path in BUILTIN:
        path = BUILTIN_DIR / BUILTIN[name_or_path]
        source = f"builtin:{name_or_path}"
    else:
        path = Path(name_or_path)
        source = str(path)
        if not path.is_file():
            raise _unknown_template(name_or_path)
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as err:
        raise ConfigError(f"judge.template: {path} is not valid YAML: {err}") from None
    if not isinstance(data, dict):
        raise ConfigError(
            f"judge.template: {path} holds a {type(data).__name__}; expected a mapping with a `user` field"
        )
    unknown = set(data) - {"name", "version", "system", "user", "reask", "verdict_prefix", "reply_format"}
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
    reply_format = data.get("reply_format") or "verdict_line"
    if reply_format not in REPLY_FORMATS:
        raise ConfigError(
            f"judge.template: {path} has reply_format {reply_format!r}; expected one of {', '.join(REPLY_FORMATS)}"
        )
    return JudgeTemplate(
        name=str(data.get("name") or path.stem),
        version=str(data.get("version", "1")),
        user=user,
        system=data.get("system") or None,
        reask=data.get("reask") or None,
        verdict_prefix=prefix,
        reply_format=reply_format,
        source=source,
    )
