"""The HF generation backend: `model.generate` (or the fused decoding loop) on the training model itself, with one
prompt prefill shared by a prompt's G completions."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from transformers import LogitsProcessor, LogitsProcessorList

from rloo_engine.algorithm import completion_mask
from rloo_engine.config_base import ConfigError
from rloo_engine.fast_path import FLOAT32_TOLERANCE, fast_path_holds
from rloo_engine.generation.base import Rollout, SamplingParams
from rloo_engine.generation.fused_decode import FusedDecoder, decode_step_difference, unsupported_reason
from rloo_engine.generation.kv_cache import cache_keyword, sequence_major_cache
from rloo_engine.generation.sampling import PROCESSOR_KWARGS, TokenSampler
from rloo_engine.vision import (
    encode_prompts,
    numbers_own_positions,
    placeholder_token_ids,
    suppressing_placeholders,
)


class SampledTokenLogProbs(LogitsProcessor):
    """Records log pi(o_t) of each sampled token while `generate` decodes, keeping O(B) per step.

    A logits processor sees step t's logits before step t's token is drawn; that token is the last
    column of `input_ids` at step t + 1. So each call gathers the previous step's log-prob and keeps
    only the current step's (B, V) log-softmax until then; `finish` gathers the last one. It runs
    after `generate`'s own processors (e.g. repetition penalty) and before its temperature, top-k and
    top-p warpers: it scores the temperature-scaled distribution, as the training forward does.
    """

    def __init__(self, temperature: float):
        self.temperature = temperature
        self.pending: torch.Tensor | None = None  # (B, V) of the step whose token is not drawn yet
        self.logps: list[torch.Tensor] = []  # T tensors of (B,)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.pending is not None:
            self.logps.append(self.pending.gather(-1, input_ids[:, -1:]).squeeze(-1))
        self.pending = torch.log_softmax(scores.float() / self.temperature, dim=-1)
        return scores

    def finish(self, sequences: torch.Tensor) -> torch.Tensor:
        """(B, T) log-probs of the T generated tokens, the last of which ends `sequences`."""
        if self.pending is not None:
            self.logps.append(self.pending.gather(-1, sequences[:, -1:]).squeeze(-1))
            self.pending = None
        return torch.stack(self.logps, dim=1)


# Of the processor kwargs (sampling.PROCESSOR_KWARGS), the ones that change the logits (the rest only stop generation early).
_LOGIT_PROCESSOR_KWARGS = PROCESSOR_KWARGS - {"stop_strings", "stopping_criteria", "max_time"}


def logit_processors_in_use(generation_config: Any, extra: dict[str, Any] | None) -> list[str]:
    """The generate-time logits processors that would change the logits the sampled tokens came from: the ones
    `extra` (generation_kwargs) names, and the ones the model's own generation_config switches on. Log-probs
    recorded while decoding include them; a training forward does not."""
    from transformers import GenerationConfig

    extra = extra or {}
    used = sorted(k for k in extra if k in _LOGIT_PROCESSOR_KWARGS and extra[k] not in (None, 0, [], {}))
    defaults = GenerationConfig()
    for name in sorted(_LOGIT_PROCESSOR_KWARGS - set(extra) - {"logits_processor"}):
        value = getattr(generation_config, name, None)
        if value is not None and value != getattr(defaults, name, None):
            used.append(f"{name} (the model's generation_config)")
    return used


def record_decoding_logprobs(cfg, policy) -> bool:
    """Whether the sampling policy's log-probs come from decoding (`sampling_logprobs`). Processors such as
    min_new_tokens or suppress_tokens change the logits the tokens were drawn from, and the training forward
    cannot see them: `auto` then uses a forward pass, and an explicit `generation` is refused."""
    if not cfg.logprobs_from_generation:
        return False
    used = logit_processors_in_use(policy.generation_config, cfg.generation_kwargs)
    if placeholder_token_ids(policy.config):
        used.append("suppress_tokens (a vision-language model's image tokens)")
    if used and cfg.sampling_logprobs == "generation":
        raise ConfigError(
            f"sampling_logprobs: 'generation' with logits processors {', '.join(used)}: decoding log-probs would "
            "include them and the training forward does not, so KL and the first ratio would be wrong; use "
            "'auto' or 'forward'"
        )
    return not used


class HFGenerationBackend:
    """Samples with `model.generate` on the (unwrapped) training model.

    The prompt prefill runs once per prompt: the prompt's KV cache is computed on P rows and then
    repeated G times, instead of `num_return_sequences=G` which prefills G copies. With `fused_decode`, the
    decoding after it runs `fused_decode.FusedDecoder` where that is `generate`'s loop for these settings (checked
    once, on the first call, against the model's own forward; `say` gets the reason when it is not).
    """

    def __init__(self, model_getter, tokenizer, params: SamplingParams, shared_prefill: bool = True,
                 gather=contextlib.nullcontext, record_logps: bool = False, fused_decode: bool = False,
                 say=lambda message: None, decode_dtype: torch.dtype | None = None, processor=None):
        self.model_getter = model_getter  # callable returning the unwrapped policy (LoRA-aware)
        self.processor = processor  # a vision-language model's: prompts with images (`generate(images=...)`)
        self.gather = gather  # context making full weights available (DeepSpeed ZeRO-3)
        self.tokenizer = tokenizer
        self.params = params
        self.shared_prefill = shared_prefill
        self.record_logps = record_logps  # fill Rollout.sampling_logps while decoding
        self.eos_ids = params.eos_token_ids or (tokenizer.eos_token_id,)
        # `generation_dtype`: the fused loop decodes in it, its log-probs reported as a generator's, not as pi_old
        self.decode_dtype = decode_dtype
        if decode_dtype is not None and not (fused_decode and shared_prefill):
            say(f"generation_dtype: {str(decode_dtype).removeprefix('torch.')} decodes in the fused loop, and "
                "fused_decode is off: sampling in the policy's dtype")
            self.decode_dtype = None
        self._fused: bool | None = None if fused_decode and shared_prefill else False  # None: not checked yet
        self.say = say

    def sync_weights(self, model: torch.nn.Module, step: int = 0) -> None:
        return None

    @property
    def own_sampler(self) -> bool:
        """Whether tokens are drawn by `sampling.TokenSampler` (faster than HF's multinomial on CPU). Extra
        generate kwargs other than logits processors and stopping rules may name warpers it does not apply
        (typical_p, epsilon/eta cutoffs, ...), so with any of those HF samples itself."""
        return set(self.params.extra or {}) <= PROCESSOR_KWARGS

    def _generation_kwargs(self, num_return_sequences: int, recorder=None) -> dict[str, Any]:
        p = self.params
        kwargs: dict[str, Any] = dict(
            max_new_tokens=p.max_completion_length,
            repetition_penalty=p.repetition_penalty,
            pad_token_id=self.tokenizer.pad_token_id,
            eos_token_id=list(self.eos_ids),
            num_return_sequences=num_return_sequences,
        )
        processors = [recorder] if recorder is not None else []
        if self.own_sampler:
            # Greedy over the sampler's output draws the sampled token. HF's own warpers would then not run,
            # so the model's generation_config cannot add a second temperature or top-p on top of ours.
            assert num_return_sequences == 1, "greedy generate repeats no rows: pass G copies of each prompt"
            kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None, min_p=None)
            processors.append(TokenSampler(p.temperature, p.top_k, p.top_p, p.min_p))
        else:
            kwargs.update(do_sample=True, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k or 0)
            if p.min_p:
                kwargs["min_p"] = p.min_p
        kwargs.update(p.extra or {})
        if processors:
            kwargs["logits_processor"] = LogitsProcessorList([*kwargs.get("logits_processor", []), *processors])
        return kwargs

    def tokenize_prompts(self, prompts: list[str], device: torch.device,
                         add_special_tokens: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Left-pads and left-truncates prompts (the end of a prompt is what the completion continues)."""
        tok = self.tokenizer
        tok.padding_side, tok.truncation_side = "left", "left"
        max_len = self.params.max_prompt_length
        enc = tok(prompts, return_tensors="pt", padding=True, truncation=max_len is not None,
                  max_length=max_len, add_special_tokens=add_special_tokens)
        return enc["input_ids"].to(device), enc["attention_mask"].to(device)

    @torch.no_grad()
    def generate(self, prompts: list[str], num_generations: int, add_special_tokens: bool = False,
                 images: list[list] | None = None) -> Rollout:
        """`images`: each prompt's images, for a vision-language model (`processor`). Its rows then run HF
        `generate` with their pixel inputs, G copies of each prompt: the shared prefill and the fused loop run a
        text decoder's cache and layers, not the vision tower."""
        model = self.model_getter()
        device = next(model.parameters()).device
        vision = None
        if images is None:
            prompt_ids, prompt_mask = self.tokenize_prompts(prompts, device, add_special_tokens)
        else:
            prompt_ids, prompt_mask, vision = encode_prompts(self.processor, prompts, images,
                                                             self.params.max_prompt_length,
                                                             numbers_own_positions(model), add_special_tokens)
            prompt_ids, prompt_mask = prompt_ids.to(device), prompt_mask.to(device)
            vision = vision.to(device).repeat(num_generations)
        was_training = model.training
        recorder = SampledTokenLogProbs(self.params.temperature) if self.record_logps or self.decode_dtype else None
        self._decoded_in = None  # the dtype the fused loop decoded this call in, when not the model's
        model.eval()
        try:
            with self.gather():
                if self.shared_prefill and prompt_ids.size(1) > 1 and vision is None:
                    sequences = self._generate_shared_prefill(model, prompt_ids, prompt_mask, num_generations,
                                                              recorder)
                else:
                    # Greedy generate (our sampler) repeats no rows itself; HF sampling does, num_return_sequences.
                    copies = num_generations if self.own_sampler or vision is not None else 1
                    kwargs = self._generation_kwargs(num_generations // copies, recorder)
                    if vision is not None:  # the rows' pixels; a sampled image token would have none (as TRL)
                        kwargs = {**suppressing_placeholders(kwargs, model.config),
                                  **vision.model_kwargs(prompt_ids.size(1))}
                    sequences = model.generate(input_ids=prompt_ids.repeat_interleave(copies, 0),
                                               attention_mask=prompt_mask.repeat_interleave(copies, 0), **kwargs)
        finally:
            model.train(was_training)
        prompt_ids = prompt_ids.repeat_interleave(num_generations, 0)
        prompt_mask = prompt_mask.repeat_interleave(num_generations, 0)
        completion_ids = sequences[:, prompt_ids.size(1):]
        mask, terminated = completion_mask(completion_ids, list(self.eos_ids))
        completion_ids = torch.where(mask.bool(), completion_ids, torch.full_like(completion_ids, self.tokenizer.pad_token_id))
        logps = recorder.finish(sequences) * mask if recorder is not None else None
        if self._decoded_in is not None:  # a bf16 sampler's log-probs: compared with pi_old, never taken for it
            return Rollout(prompt_ids, prompt_mask, completion_ids, mask, terminated, generator_logps=logps,
                           generator_logps_processed=False)
        return Rollout(prompt_ids, prompt_mask, completion_ids, mask, terminated,
                       logps if self.record_logps else None, vision=vision)

    def _generate_shared_prefill(self, model, prompt_ids, prompt_mask, g: int, recorder=None) -> torch.Tensor:
        """Prefills prompt[:, :-1] once, repeats the cache G times, lets `generate` (or `FusedDecoder`) continue from
        the last token. The cache appends each decoded token in place (kv_cache.py), reserving the prompt and every
        new token."""
        cache = sequence_major_cache(model.config, prompt_ids.size(1) + self.params.max_completion_length)
        cache_arg = {cache_keyword(model): cache}
        prefix_mask = prompt_mask[:, :-1]
        position_ids = (prefix_mask.cumsum(-1) - 1).clamp(min=0)
        # Only the cache is wanted; logits_to_keep=1 avoids a (P, prompt_len, vocab) logits tensor.
        model(input_ids=prompt_ids[:, :-1], attention_mask=prefix_mask, position_ids=position_ids,
              use_cache=True, logits_to_keep=1, **cache_arg)
        cache.batch_repeat_interleave(g)
        prompt_ids, prompt_mask = prompt_ids.repeat_interleave(g, 0), prompt_mask.repeat_interleave(g, 0)
        if self._fused_decode_runs(model):
            p = self.params
            self._decoded_in = self.decode_dtype
            decoder = FusedDecoder(model, prompt_ids.size(1) + p.max_completion_length, dtype=self.decode_dtype)
            draw = TokenSampler(p.temperature, p.top_k, p.top_p, p.min_p).draw
            return decoder.decode(cache, prompt_ids, prompt_mask[:, :-1], p.max_completion_length,
                                  [recorder] if recorder is not None else [], draw, self.eos_ids,
                                  self.tokenizer.pad_token_id)
        return model.generate(input_ids=prompt_ids, attention_mask=prompt_mask, **cache_arg,
                              **self._generation_kwargs(1, recorder))

    def _fused_decode_runs(self, model) -> bool:
        """Whether `FusedDecoder` decodes: asked for, and on the first call the model and settings are ones it
        covers and its step gives the model's own log-probs on a probe batch (`fast_path_holds`)."""
        if self._fused is None:
            def measure() -> float | str:
                why = unsupported_reason(model, self.params.extra, self.params.repetition_penalty)
                if why is None and self.tokenizer.pad_token_id is None:
                    why = "the tokenizer has no pad token"
                return why if why is not None else decode_step_difference(model, len(self.tokenizer))

            # float32 only (unsupported_reason refuses the rest), so the float32 tolerance
            self._fused = fast_path_holds("fused_decode", measure, FLOAT32_TOLERANCE, "decoding with HF generate",
                                          self.say)
        return self._fused

