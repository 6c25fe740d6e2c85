"""The `python` judge: a `module:function` callable, e.g. an offline gold rule for demos and tests.

Per-pair form (default):   `f(prompt: str, answer_a: str, answer_b: str) -> "A" | "B" | "tie"`
Batched form (`batched`):  `f(prompts: list[str], answers_a: list[str], answers_b: list[str]) -> list[...]`

A return value may also be judge text ending in a `Preferred: A|B` line; anything else counts
as a `parse_error` (with the value recorded), never as a guess. `async def` functions are awaited
on the event loop; plain functions run in a worker thread, so a slow rule never blocks it. An
exception raised by the function stops the evaluation: it is a bug in the rule, not a judgment.
The source of the function's module is part of the cache key, so editing the rule (or a helper it calls) re-judges.
"""

from __future__ import annotations

import asyncio
import hashlib
import inspect
from collections.abc import Callable, Sequence
from typing import Any

from rloo_engine.evaluation.config import JudgeConfig
from rloo_engine.evaluation.judges.base import Judge, Judgment, OnJudgment, SlotPair
from rloo_engine.evaluation.parsing import parse_label
from rloo_engine.import_paths import load_callable


def _source_hash(fn: Callable[..., Any]) -> str:
    """Hash of the source of the function's whole module: a rule usually calls helpers (scores, weights)
    defined beside it, and editing any of them must re-judge rather than reuse cached verdicts."""
    try:
        source = inspect.getsource(inspect.getmodule(fn) or fn)
    except (OSError, TypeError):
        try:
            source = inspect.getsource(fn)
        except (OSError, TypeError):
            source = f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', repr(fn))}"
    return hashlib.sha256(source.encode("utf-8")).hexdigest()[:16]


class PythonJudge(Judge):
    backend = "python"

    def __init__(self, cfg: JudgeConfig):
        assert cfg.function is not None
        self.function_path = cfg.function
        self.fn = load_callable(cfg.function, "judge.function")
        self.batched = cfg.batched
        self.batch_size = cfg.batch_size if cfg.batched else 64
        self.is_async = inspect.iscoroutinefunction(self.fn)
        self._source = _source_hash(self.fn)

    def __repr__(self) -> str:
        return f"PythonJudge(function={self.function_path!r})"

    def identity(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "function": self.function_path,
            "source": self._source,
            "batched": self.batched,
        }

    def _to_judgments(self, values: Sequence[Any], n: int) -> list[Judgment]:
        if not isinstance(values, (list, tuple)) or len(values) != n:
            raise TypeError(
                f"judge.function {self.function_path!r} returned {type(values).__name__} "
                f"of length {len(values) if hasattr(values, '__len__') else '?'}; expected a list of {n} verdicts"
            )
        judgments = []
        for value in values:
            verdict = parse_label(value)
            raw = value if isinstance(value, str) else repr(value)
            if verdict is None:
                error = f"returned {raw[:80]!r}; expected 'A', 'B', 'tie' or text ending in 'Preferred: A|B'"
                judgments.append(Judgment(status="parse_error", raw_texts=[raw], error=error))
            else:
                judgments.append(Judgment(status="ok", verdict=verdict, raw_texts=[raw]))
        return judgments

    def _judge_batch(self, pairs: Sequence[SlotPair]) -> list[Judgment]:
        if self.batched:
            values = self.fn([p.prompt for p in pairs], [p.answer_a for p in pairs], [p.answer_b for p in pairs])
        else:
            values = [self.fn(p.prompt, p.answer_a, p.answer_b) for p in pairs]
        return self._to_judgments(values, len(pairs))

    async def judge(self, pairs: Sequence[SlotPair], on_judgment: OnJudgment | None = None) -> list[Judgment]:
        if not self.is_async:
            return await super().judge(pairs, on_judgment)
        results: list[Judgment] = []
        for start in range(0, len(pairs), self.batch_size):
            batch = list(pairs[start : start + self.batch_size])
            if self.batched:
                values = await self.fn(
                    [p.prompt for p in batch], [p.answer_a for p in batch], [p.answer_b for p in batch]
                )
            else:
                values = await asyncio.gather(*(self.fn(p.prompt, p.answer_a, p.answer_b) for p in batch))
            judged = self._to_judgments(list(values), len(batch))
            for offset, judgment in enumerate(judged):
                if on_judgment is not None:
                    on_judgment(start + offset, judgment)
            results.extend(judged)
        return results
