"""Token usage and cost of judge calls, and the budget guard that stops a run before it overspends.

Before each request the guard reserves its worst case: the prompt's estimated tokens plus
`max_tokens` of reply. A request starts only if the spend so far, the reservations of requests in
flight and its own reservation all fit in the budget, so the budget holds even with 32 requests
in flight. When the reply arrives, the reservation is replaced by the real usage. A Batch API
submission reserves the worst case of all its rows at batch prices before anything is uploaded, and
keeps it until the batch's results are downloaded; a batch an earlier run submitted is held the
same way (without the check: it is billed whatever this run decides).
"""

from __future__ import annotations

from dataclasses import dataclass

from rloo_engine.evaluation.errors import BudgetExceededError

# Prompt tokens per character before any reply has reported real counts: 1 token per 2 characters
# is above what BPE tokenizers give for English (about 1 per 4), so early estimates err high.
_INITIAL_TOKENS_PER_CHAR = 0.5


@dataclass(frozen=True)
class Price:
    input_per_million: float
    output_per_million: float
    batch_input_per_million: float | None = None  # None: half the live price (OpenAI's Batch API discount)
    batch_output_per_million: float | None = None

    def cost(self, prompt_tokens: float, completion_tokens: float, batch: bool = False) -> float:
        if not batch:
            return (prompt_tokens * self.input_per_million + completion_tokens * self.output_per_million) / 1e6
        inp = self.input_per_million / 2 if self.batch_input_per_million is None else self.batch_input_per_million
        out = self.output_per_million / 2 if self.batch_output_per_million is None else self.batch_output_per_million
        return (prompt_tokens * inp + completion_tokens * out) / 1e6


class SpendTracker:
    """Counts tokens and requests of this run; enforces `budget_usd` when a price is known."""

    def __init__(self, price: Price | None = None, budget_usd: float | None = None, model: str = ""):
        if budget_usd is not None and price is None:
            raise ValueError(f"budget_usd: {budget_usd} needs a price for judge model {model!r}")
        self.price = price
        self.budget_usd = budget_usd
        self.model = model
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self._spent = 0.0  # at the price of each request's mode (live or batch)
        self.requests = 0  # HTTP requests sent, retries included
        self._reserved = 0.0
        self._tokens_per_char = 0.0  # the highest ratio seen in replies; 0 until the first reply

    @property
    def cost_usd(self) -> float | None:
        return None if self.price is None else self._spent

    def reserve(self, prompt_chars: int, max_completion_tokens: int, rows: int = 1, batch: bool = False) -> float:
        """Reserves the worst-case cost of a request (or of a batch of `rows` requests totalling `prompt_chars`),
        or raises BudgetExceededError if it might not fit."""
        if self.budget_usd is None or self.price is None:
            return 0.0
        worst = self._worst_case(prompt_chars, max_completion_tokens, rows, batch)
        spent = self.cost_usd or 0.0
        if spent + self._reserved + worst > self.budget_usd:
            what = f"a batch of {rows} requests" if batch else "the next call"
            raise BudgetExceededError(
                f"budget_usd: stopping before {what}; spent ${spent:.4f} of ${self.budget_usd:.4f} "
                f"(${self._reserved:.4f} more reserved by calls in flight) and {what} to {self.model!r} "
                f"could cost up to ${worst:.4f}. Finished judgments are cached: raise budget_usd (or lower "
                "max_prompts) and rerun to continue."
            )
        self._reserved += worst
        return worst

    def hold(self, prompt_chars: int, max_completion_tokens: int, rows: int = 1, batch: bool = False) -> float:
        """Reserves the worst-case cost of requests already sent (a batch submitted by an earlier run), whether it
        fits or not: they will be billed anyway, and what this run sends next must fit beside them."""
        if self.budget_usd is None or self.price is None:
            return 0.0
        worst = self._worst_case(prompt_chars, max_completion_tokens, rows, batch)
        self._reserved += worst
        return worst

    def _worst_case(self, prompt_chars: int, max_completion_tokens: int, rows: int, batch: bool) -> float:
        assert self.price is not None
        ratio = self._tokens_per_char * 1.25 if self._tokens_per_char else _INITIAL_TOKENS_PER_CHAR
        return self.price.cost(prompt_chars * ratio + 16 * rows, max_completion_tokens * rows, batch=batch)

    def release(self, reservation: float) -> None:
        self._reserved = max(0.0, self._reserved - reservation)

    def record(self, prompt_chars: int, prompt_tokens: int, completion_tokens: int, batch: bool = False) -> None:
        self.prompt_tokens += prompt_tokens
        self.completion_tokens += completion_tokens
        if self.price is not None:
            self._spent += self.price.cost(prompt_tokens, completion_tokens, batch=batch)
        if prompt_chars > 0 and prompt_tokens > 0:
            self._tokens_per_char = max(self._tokens_per_char, prompt_tokens / prompt_chars)
