"""The `reward_model` judge: a (gold) sequence-classification reward model scores each answer.

Scoring is the training engine's (`rloo_engine.reward_sources.RewardModelSource`): `prompt + answer`
re-tokenized with the reward model's own tokenizer, left-truncated to `max_length` so the answer
is kept, the score read at the last real token. So the judge scores exactly as training rewarded.
The verdict is the higher score; a gap at or below `tie_margin` is a tie. Scores are memoised per
(prompt, answer), so judging both orders costs one forward pass per answer. The raw text records
both scores.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from rloo_engine.config_base import ConfigError
from rloo_engine.evaluation.config import JudgeConfig
from rloo_engine.evaluation.hf_models import weights_fingerprint
from rloo_engine.evaluation.judges.base import Judge, Judgment, SlotPair


class RewardModelJudge(Judge):
    backend = "reward_model"

    def __init__(self, cfg: JudgeConfig):
        assert cfg.model is not None
        self.model_path = cfg.model
        self.tie_margin = cfg.tie_margin
        self.batch_size = cfg.batch_size
        self.max_length = cfg.max_length
        self._dtype, self._device = cfg.dtype, cfg.device
        self._fingerprint = weights_fingerprint(cfg.model)
        self._scores: dict[tuple[str, str], float] = {}
        self._source: Any = None  # the engine's RewardModelSource, loaded on first use

    def __repr__(self) -> str:
        return f"RewardModelJudge(model={self.model_path!r})"

    def identity(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "model": self.model_path,
            "weights": self._fingerprint,
            "tie_margin": self.tie_margin,
            "max_length": self.max_length,
            "dtype": self._dtype,
        }

    def score(self, prompts: Sequence[str], answers: Sequence[str]) -> list[float]:
        """Reward of each (prompt, answer)."""
        if self._source is None:
            from rloo_engine.evaluation.hf_models import resolve_device, resolve_dtype
            from rloo_engine.reward_sources import RewardModelSource

            try:
                self._source = RewardModelSource(
                    self.model_path,
                    device=resolve_device(self._device),
                    dtype=resolve_dtype(self._dtype),
                    batch_size=self.batch_size * 2,  # a judge batch of pairs holds up to two answers each
                    max_length=self.max_length,
                )
            except ConfigError as err:
                raise ConfigError(f"judge.model: {err}") from None
        return list(self._source(list(prompts), list(answers)))

    def _judge_batch(self, pairs: Sequence[SlotPair]) -> list[Judgment]:
        todo = sorted({(p.prompt, a) for p in pairs for a in (p.answer_a, p.answer_b)} - self._scores.keys())
        if todo:
            scores = self.score([prompt for prompt, _ in todo], [answer for _, answer in todo])
            self._scores.update(zip(todo, scores, strict=True))
        judgments = []
        for p in pairs:
            score_a, score_b = self._scores[(p.prompt, p.answer_a)], self._scores[(p.prompt, p.answer_b)]
            gap = score_a - score_b
            verdict = "tie" if abs(gap) <= self.tie_margin else ("A" if gap > 0 else "B")
            raw = json.dumps({"score_A": round(score_a, 6), "score_B": round(score_b, 6)})
            judgments.append(Judgment(status="ok", verdict=verdict, raw_texts=[raw]))
        return judgments

    async def aclose(self) -> None:
        self._source = None
