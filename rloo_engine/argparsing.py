"""The argument parser every command of this repository uses: no prefix matching, one-line errors with a suggestion.

argparse accepts any unambiguous prefix of a flag by default, so `--num_generation 4` silently sets
`num_generations` and `--per_device 8` is taken too; a typo then changes a different option than the
one the user meant, or none. `StrictArgumentParser` turns that off (`allow_abbrev=False`) and reports
an unknown flag on one line with the closest known flag, instead of the full usage text.
"""

from __future__ import annotations

import argparse
import difflib
import re
import sys
from typing import NoReturn

_UNRECOGNIZED = re.compile(r"^unrecognized arguments: (?P<args>.*)$")
# argparse %-formats every help string; a `%` that starts no `%(name)s` or `%%` is prose ("~30% slower").
_PERCENT = re.compile(r"%%|%\(|%")
_NUMBER = re.compile(r"^-\.?\d")  # a negative value, not a flag


class StrictArgumentParser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs) -> None:
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)

    def add_argument(self, *args, **kwargs):
        if isinstance(kwargs.get("help"), str):
            kwargs["help"] = _PERCENT.sub(lambda m: "%%" if m.group() == "%" else m.group(), kwargs["help"])
        return super().add_argument(*args, **kwargs)

    def known_flags(self) -> list[str]:
        """Long flags shown in --help (hidden compatibility flags are accepted but never suggested)."""
        return sorted(
            flag
            for action in self._actions
            if action.help is not argparse.SUPPRESS
            for flag in action.option_strings
            if flag.startswith("--")
        )

    def suggestion(self, flag: str) -> str | None:
        """The known flags `flag` most likely meant: those it is a prefix of (`--per_device` ->
        `--per_device_train_batch_size`), else the closest spelling (`--num_generation` -> `--num_generations`)."""
        flag = flag.split("=", 1)[0]
        known = self.known_flags()
        if prefixed := [k for k in known if k.startswith(flag)]:
            return " or ".join(prefixed[:3]) + (" or ..." if len(prefixed) > 3 else "")
        matches = difflib.get_close_matches(flag, known, n=1, cutoff=0.6)
        return matches[0] if matches else None

    def parse_known_args(self, args=None, namespace=None):
        self._argv = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(args, namespace)

    def unknown_flags(self, tokens: list[str]) -> list[str]:
        return [
            t for t in tokens
            if t.startswith("-") and not _NUMBER.match(t) and t.split("=", 1)[0] not in self._option_string_actions
        ]

    def error(self, message: str) -> NoReturn:
        """One line: what is wrong, the closest known flag for an unknown one, and where the options are listed."""
        hint = ""
        m = _UNRECOGNIZED.match(message)
        # A misspelt required flag is first reported as "required: --config"; the typo is the real news.
        unknown = self.unknown_flags(m.group("args").split() if m else getattr(self, "_argv", []))
        if m or unknown:
            if unknown:
                message = f"unknown option{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}"
                suggestions = {flag: s for flag in unknown if (s := self.suggestion(flag))}
                if len(unknown) == 1 and suggestions:
                    hint = f"; did you mean {suggestions[unknown[0]]}?"
                elif suggestions:
                    hint = "; did you mean " + ", ".join(f"{s} (for {flag})" for flag, s in suggestions.items()) + "?"
        self.exit(2, f"{self.prog}: error: {message}{hint} (`{self.prog} --help` lists the options)\n")
