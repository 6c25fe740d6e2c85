"""The `hf` judge: a local transformers chat model, judging by the probabilities of the verdict labels.

The judge prompt is rendered with the model's chat template, then the assistant turn is started
with the verdict prefix (`Preferred:`). The verdict is the label, ` A` or ` B`, with the higher
log-probability as a continuation; a gap at or below `tie_margin` is a tie. Nothing is generated,
so there is nothing to parse: the raw text records both log-probabilities.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from rloo_engine.evaluation.config import JudgeConfig
from rloo_engine.evaluation.hf_models import load_causal_lm, weights_fingerprint
from rloo_engine.evaluation.judges.base import Judge, Judgment, SlotPair
from rloo_engine.evaluation.templates import JudgeTemplate

LABELS = ("A", "B")


class HFJudge(Judge):
    backend = "hf"

    def __init__(self, cfg: JudgeConfig, template: JudgeTemplate):
        assert cfg.model is not None
        self.model_path = cfg.model
        self.template = template
        self.tie_margin = cfg.tie_margin
        self.batch_size = cfg.batch_size
        self.max_length = cfg.max_length
        self._dtype, self._device = cfg.dtype, cfg.device
        self._fingerprint = weights_fingerprint(cfg.model)
        self._model: Any = None
        self._tokenizer: Any = None

    def __repr__(self) -> str:
        return f"HFJudge(model={self.model_path!r})"

    @property
    def template_hash(self) -> str:
        return self.template.hash

    def identity(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "model": self.model_path,
            "weights": self._fingerprint,
            "template": self.template.hash,
            "tie_margin": self.tie_margin,
            "max_length": self.max_length,
            "dtype": self._dtype,
        }

    def _load(self) -> None:
        if self._model is None:
            self._model, self._tokenizer = load_causal_lm(self.model_path, self._dtype, self._device, "judge.model")

    def prompt_ids(self, pair: SlotPair) -> list[int]:
        """Token ids of the judge prompt up to and including the verdict prefix (left-truncated to max_length)."""
        self._load()
        tok = self._tokenizer
        messages = self.template.render(pair.prompt, pair.answer_a, pair.answer_b, pair.reference)
        if tok.chat_template:
            text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        else:
            text = "\n\n".join(m["content"] for m in messages) + "\n\n"
        ids = tok(text + f"{self.template.verdict_prefix}:", add_special_tokens=False)["input_ids"]
        return ids[-(self.max_length - 4) :]

    def label_logprobs(self, pairs: Sequence[SlotPair]) -> list[tuple[float, float]]:
        """(log p(" A" | prompt), log p(" B" | prompt)) for each pair, in one padded forward pass."""
        return self._label_logprobs([self.prompt_ids(pair) for pair in pairs])

    def _label_logprobs(self, prefixes: list[list[int]]) -> list[tuple[float, float]]:
        import torch

        self._load()
        tok, model = self._tokenizer, self._model
        label_ids = [tok(f" {label}", add_special_tokens=False)["input_ids"] for label in LABELS]
        rows, spans = [], []
        for prefix in prefixes:
            for ids in label_ids:
                rows.append(prefix + ids)
                spans.append(len(ids))
        width = max(len(r) for r in rows)
        pad = tok.pad_token_id
        # Left padding, so every label ends at the last position; explicit position ids keep the
        # padded rows' positions identical to an unpadded forward pass.
        input_ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        device = next(model.parameters()).device
        with torch.no_grad():
            logits = model(
                input_ids=input_ids.to(device), attention_mask=mask.to(device), position_ids=positions.to(device)
            ).logits.float()
        logprobs = torch.log_softmax(logits[:, :-1], dim=-1)
        targets = input_ids[:, 1:].to(device)
        token_lp = logprobs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # (rows, width - 1)
        totals = [float(token_lp[i, -n:].sum()) for i, n in enumerate(spans)]
        return [(totals[2 * i], totals[2 * i + 1]) for i in range(len(prefixes))]

    def _judge_batch(self, pairs: Sequence[SlotPair]) -> list[Judgment]:
        prefixes = [self.prompt_ids(pair) for pair in pairs]
        judgments = []
        for prefix, (lp_a, lp_b) in zip(prefixes, self._label_logprobs(prefixes), strict=True):
            gap = lp_a - lp_b
            verdict = "tie" if abs(gap) <= self.tie_margin else ("A" if gap > 0 else "B")
            raw = json.dumps({"logprob_A": round(lp_a, 6), "logprob_B": round(lp_b, 6)})
            judgments.append(Judgment(status="ok", verdict=verdict, raw_texts=[raw], prompt_tokens=len(prefix)))
        return judgments

    async def aclose(self) -> None:
        self._model = None
