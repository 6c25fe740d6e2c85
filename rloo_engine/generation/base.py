"""What every generation backend is: `generate(prompts, G) -> Rollout` and `sync_weights(model, step)`. The trainer
knows its backend only through this interface (and `factory.build_backend`, which picks one)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch


@dataclass
class Rollout:
    """Tokenised prompts and their sampled completions, grouped: rows [k*G, (k+1)*G) share prompt k.

    prompt_ids, prompt_mask: (N, P) left-padded; completion_ids: (N, T) with pad after the first EOS;
    completion_mask: (N, T) 1 up to and including the first EOS; terminated: (N,) bool.
    sampling_logps: (N, T) float32 log pi(o_t) at the sampling temperature, recorded while decoding
    (0 where masked), or None when the backend did not record them. The trainer uses them as pi_old.
    generator_logps: (N, T) float32 log-prob a sampler other than the trainer's own policy reported for each
    sampled token at the sampling temperature, 0 where masked: vLLM's (after its processors: its processed
    log-probs, `generator_logps_processed`), or the HF backend's bfloat16 decoding (`generation_dtype`, the full
    distribution); None when the HF backend samples in the policy's dtype. Never pi_old: the trainer compares them
    with its own forward pass (the mismatch metrics) and forms importance weights from them
    (`vllm_importance_sampling_correction`).
    """

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    completion_ids: torch.Tensor
    completion_mask: torch.Tensor
    terminated: torch.Tensor
    sampling_logps: torch.Tensor | None = None
    generator_logps: torch.Tensor | None = None
    generator_logps_processed: bool = True  # of the truncated distribution when top_k / top_p / min_p are on
    vision: Any = None  # a vision-language model's pixel inputs of the N rows (`vision.VisionRows`)


@dataclass
class SamplingParams:
    max_completion_length: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float = 1.0
    max_prompt_length: int | None = None
    extra: dict[str, Any] | None = None
    eos_token_ids: tuple[int, ...] = ()  # every id that ends a completion (see models.eos_token_ids)

    def truncation(self) -> dict[str, Any] | None:
        """The truncation sampling applies (top_k, top_p, min_p), or None when it samples the full softmax."""
        if not (self.top_k or self.top_p < 1.0 or self.min_p):
            return None
        return {"top_k": self.top_k, "top_p": self.top_p, "min_p": self.min_p}


class GenerationBackend(Protocol):
    def generate(self, prompts: list[str], num_generations: int, add_special_tokens: bool = False) -> Rollout:
        """Samples `num_generations` completions for each rendered prompt string.

        `add_special_tokens`: tokenize with the tokenizer's special tokens (e.g. BOS), as plain-text
        prompts need; prompts rendered by a chat template already contain them.
        """

    def sync_weights(self, model: torch.nn.Module, step: int = 0) -> None:
        """Makes the backend sample from `model`'s current weights, those of optimizer step `step` (no-op when
        it samples from `model` itself)."""
