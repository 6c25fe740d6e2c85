"""Token usage and cost of judge calls, and the budget guard that stops a run before it overspends.

Before each request the guard reserves its worst case: the prompt's estimated tokens plus
`max_tokens` of reply. A request starts only if the spend so far, the reservations of requests in
flight and its own reservation all fit in the budget, so the budget holds even with 32 requests
in flight. When the reply arrives, the reservation is replaced by the real usage.
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

    def cost(self, prompt_tokens: float, completion_tokens: float) -> float:
        return (prompt_tokens * self.input_per_million + completion_tokens * self.output_per_million) / 1e6


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
        self.requests = 0  # HTTP requests sent, retries included
        self._reserved = 0.0
        self._tokens_per_char = 0.0  # the highest ratio seen in replies; 0 until the first reply

    @property
    def cost_usd(self) -> float | None:
        return None if self.price is None else self.price.cost(self.prompt_tokens, self.completion_tokens)

    def reserve(self, prompt_chars: int, max_completion_tokens: int) -> float:
        """Reserves the worst-case cost of one request, or raises BudgetExceededError if it might not fit."""
        if self.budget_usd is None or self.price is None:
            return 0.0
        ratio = self._tokens_per_char * 1.25 if self._tokens_per_char else _INITIAL_TOKENS_PER_CHAR
        worst = self.price.cost(prompt_chars * ratio + 16, max_completion_tokens)
        spent = self.cost_usd or 0.0
        if spent + self._reserved + worst > self.budget_usd:
            raise BudgetExceededError(
                f"budget_usd: stopping before the next judge call; spent ${spent:.4f} of ${self.budget_usd:.4f} "
                f"(${self._reserved:.4f} more reserved by calls in flight) and the next call to {self.model!r} "
                f"could cost up to ${worst:.4f}. Finished judgments are cached: raise budget_usd and rerun to continue."
            )
        self._reserved += worst
        return worst

    def release(self, reservation: float) -> None:
        self._reserved = max(0.0, self._reserved - reservation)

    def record(self, prompt_chars: int, prompt_tokens: int, completion_tokens: int) -> None:
        self.prompt_tokens += prompt_tokens
        self.completion_tokens += completion_tokens
        if prompt_chars > 0 and prompt_tokens > 0:
            self._tokens_per_char = max(self._tokens_per_char, prompt_tokens / prompt_chars)
