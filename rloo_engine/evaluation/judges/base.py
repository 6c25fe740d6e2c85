"""The judge interface: `await judge.judge(pairs) -> judgments`, one judgment per pair, in order.

A `SlotPair` is what one judge call sees: a prompt and two answers in the slots they are shown
in (A first). Every judgment ends in exactly one status:

- `ok`: a verdict `A`, `B` or `tie` (ties come from score-based judges within their margin); a soft verdict
  (`judge.verdict: logprobs`) also carries `slot_a_probability`, and `verdict` is its argmax;
- `parse_error`: the judge answered, but its verdict did not parse even after one re-ask, or it refused
  to judge (a refusal is not re-asked);
- `api_error`: the call failed after its bounded retries.

Failures are values, not exceptions, so that every judgment is accounted for. Exceptions are kept
for problems no judgment can survive (bad key or model: `JudgeEndpointError`; budget:
`BudgetExceededError`).
"""

from __future__ import annotations

import abc
import asyncio
import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from rloo_engine.evaluation.parsing import SlotVerdict

Status = Literal["ok", "parse_error", "api_error"]
OnJudgment = Callable[[int, "Judgment"], None]


@dataclass(frozen=True)
class SlotPair:
    """One judge call's input: the prompt text and the answers as shown, `answer_a` in slot A, and the prompt's
    gold answer for a reference-guided template (None for the others). `images`: the references of the prompt's
    images; judges see text only, and the references are part of the cache key, so the same text over another
    image is another judgment."""

    prompt: str
    answer_a: str
    answer_b: str
    reference: str | None = None
    images: tuple[str, ...] = ()


@dataclass
class Judgment:
    """The outcome of judging one SlotPair."""

    status: Status
    verdict: SlotVerdict | None = None
    raw_texts: list[str] = field(default_factory=list)  # every reply of the judge, first ask then re-ask
    prompt_tokens: int = 0
    completion_tokens: int = 0
    requests: int = 0  # HTTP requests sent, retries included (0 for local judges); a batch row counts 1
    error: str | None = None
    batch_prompt_tokens: int = 0  # the part of the token counts above billed at Batch API prices
    batch_completion_tokens: int = 0
    served_model: str | None = None  # the model id the endpoint's reply named (gpt-4o -> gpt-4o-2024-08-06)
    parser_version: int | None = None  # `parsing.PARSER_VERSION` of the verdict parse; None: no text was parsed
    slot_a_probability: float | None = None  # soft verdict: P(A) / (P(A) + P(B)); None for a hard verdict

    def to_json(self) -> str:
        return json.dumps(asdict(self), ensure_ascii=False)

    @classmethod
    def from_json(cls, text: str) -> Judgment:
        return cls(**json.loads(text))


class Judge(abc.ABC):
    """Base of every backend. Subclasses implement `identity` and `_judge_batch` or `judge`."""

    backend: str = ""
    batch_size: int = 8

    @abc.abstractmethod
    def identity(self) -> dict[str, Any]:
        """What determines a verdict besides the pair (backend, model, template hash, decoding
        parameters); it is part of every cache key, so changing any of it re-judges."""

    @property
    def template_hash(self) -> str | None:
        """Hash of the judge prompt template, recorded with each judgment (None for judges without one)."""
        return None

    def _judge_batch(self, pairs: Sequence[SlotPair]) -> list[Judgment]:
        """Synchronous batch judging for local backends; runs in a worker thread, off the event loop."""
        raise NotImplementedError

    async def judge(self, pairs: Sequence[SlotPair], on_judgment: OnJudgment | None = None) -> list[Judgment]:
        """Judges `pairs`, calling `on_judgment(index, judgment)` as soon as each one is known."""
        results: list[Judgment] = []
        for start in range(0, len(pairs), self.batch_size):
            batch = list(pairs[start : start + self.batch_size])
            judged = await asyncio.to_thread(self._judge_batch, batch)
            for offset, judgment in enumerate(judged):
                if on_judgment is not None:
                    on_judgment(start + offset, judgment)
            results.extend(judged)
        return results

    def reparse(self, judgment: Judgment) -> bool:
        """Parses a cached judgment's stored replies again if its parser is outdated; True when it changed.

        Judges that parse no reply text keep their cached judgments as they are."""
        return False

    def run_info(self) -> dict[str, Any]:
        """What this judge did beyond the judgments, for the report (e.g. the batches it submitted)."""
        return {}

    async def aclose(self) -> None:  # noqa: B027 (a no-op by default, not abstract)
        """Releases clients or models; the judge is not used afterwards."""
