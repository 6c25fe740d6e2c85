"""`build_backend`: the one place that picks the generation backend a config asks for."""

from __future__ import annotations

from rloo_engine.generation.base import GenerationBackend, SamplingParams


def build_backend(cfg, tokenizer, params: SamplingParams, acc, *, policy_getter, gather, record_logps: bool,
                  position_limit: int | None, say, processor=None) -> GenerationBackend:
    """The backend `cfg` asks for: HF `generate` on the training policy (default), a colocated vLLM engine in each
    process, or a vLLM server. vLLM's modules are imported only here, when asked for (it is an optional extra)."""
    from rloo_engine.vision import numbers_own_positions, placeholder_token_ids

    if cfg.use_vllm and cfg.vllm_mode == "server":
        from rloo_engine.generation.vllm_server import VLLMServerBackend

        vision = {} if processor is None else dict(
            processor=processor, own_positions=numbers_own_positions(policy_getter()),
            placeholder_ids=tuple(placeholder_token_ids(policy_getter().config)))
        return VLLMServerBackend(cfg.vllm_server_url, tokenizer, params, acc, cfg.vllm_server_timeout,
                                 cfg.vllm_group_port, cfg.seed, cfg.vllm_structured_outputs_regex, **vision)
    if cfg.use_vllm:
        from rloo_engine.generation.vllm_colocate import ProcessLayout, VLLMColocateBackend

        layout = ProcessLayout(acc.process_index, acc.local_process_index, acc.num_processes)
        backend = VLLMColocateBackend(cfg.model_name_or_path, tokenizer, params, cfg.vllm_gpu_memory_utilization,
                                      cfg.vllm_tensor_parallel_size, cfg.seed, cfg.dtype,
                                      position_limit=position_limit, sleep_mode=cfg.vllm_enable_sleep_mode,
                                      layout=layout, max_model_length=cfg.vllm_max_model_length,
                                      structured_outputs_regex=cfg.vllm_structured_outputs_regex,
                                      revision=cfg.model_revision, trust_remote_code=cfg.trust_remote_code,
                                      processor=processor,
                                      own_positions=processor is not None and numbers_own_positions(policy_getter()))
        acc.wait_for_everyone()  # every rank's engine is up before the first collective of training
        return backend
    import torch

    from rloo_engine.generation.hf import HFGenerationBackend

    decode_dtype = torch.bfloat16 if cfg.generation_dtype == "bfloat16" else None
    return HFGenerationBackend(policy_getter, tokenizer, params, gather=gather, record_logps=record_logps,
                               fused_decode=cfg.fused_decode, say=say, decode_dtype=decode_dtype, processor=processor)
