"""RLOOConfig: the engine's typed, validated option set, with TRL's RLOOConfig names and meanings.

Every field is documented where it is declared; `docs/configuration.md` is generated from these
descriptions (`python scripts/config_reference.py`; a test fails when it is stale), so the reference cannot drift.
"""

from __future__ import annotations

import importlib.util
import math
import re
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BeforeValidator, model_validator

from rloo_engine.config_base import ConfigError, F, import_paths, validated
from rloo_engine.config_eval_options import EvalOptions
from rloo_engine.config_model_options import LoraOptions, ModelLoadingOptions
from rloo_engine.config_vllm_options import VLLMOptions


def _tracker_list(value: Any) -> Any:
    """`report_to` as TRL takes it: one name or a list; `none` alone (or null, as transformers reads it) is no tracker.
    In the type, so the pipeline's copy of the field (`train.report_to`) reads it the same way."""
    names = [value] if isinstance(value, str) else value
    return [] if names is None or names == ["none"] else names


class RLOOConfig(EvalOptions, LoraOptions, VLLMOptions, ModelLoadingOptions):
    """All options of `rloo-engine train`. Names follow TRL's RLOOConfig / `trl rloo` script arguments. The
    model-loading, vLLM, LoRA and evaluation options are declared in their mixins (`config_model_options.py`,
    `config_vllm_options.py`, `config_eval_options.py`); every check that combines options is here. Constructed in
    Python it may leave the model, data and rewards unset (`RLOOTrainer` gives them, as TRL's `RLOOConfig` leaves
    them to the trainer); `build_config`, the command line's and YAML's boundary, requires them (`check_inputs`)."""

    # ---------------------------------------------------------------- model, reward and data
    reward_model_name_or_path: str | None = F(
        None,
        "Reward model: an `AutoModelForSequenceClassification` with `num_labels=1` (local dir or hub id). "
        "Scored with its own tokenizer, so it may differ from the policy's.",
    )
    reward_funcs: Annotated[list[str], import_paths(
        "a config names functions by import path ('module:function'); pass callables to RLOOTrainer(reward_funcs=...)")] = F(
        [],
        "Reward functions as `module:function` import paths (sync or `async def`). Each is called as TRL calls it: "
        "`prompts=`, `completions=`, `completion_ids=` and every extra dataset column as keyword lists, plus "
        "`trainer_state=` (transformers' `TrainerState`: `global_step` = optimizer steps done, `max_steps`, `epoch`, "
        "`log_history`, ...), `log_extra(column, values)` (one value per completion: a column of `completions.jsonl` "
        "and the MLflow completions table) and `log_metric(name, value)` (logged as `name` beside `kl`, the mean of "
        "every process's values); it returns one float (or None = unscorable) per completion.",
    )
    reward_weights: list[float] | None = F(
        None,
        "Weight of each reward source, in order: the reward model first (if any), then `reward_funcs`. "
        "None = all weights 1.0.",
    )
    dataset_name: str | None = F(
        None,
        "Prompt dataset: a hub id, a local dataset directory, or a .jsonl/.json/.parquet/.csv file. Rows "
        "need a `prompt` column (a string, or a list of chat messages rendered with the chat template).",
    )
    dataset_config: str | None = F(None, "Dataset configuration name for hub datasets with several configs.")
    dataset_train_split: str = F("train", "Split to train on.")
    max_prompt_length: int | None = F(
        512,
        "Prompts longer than this many tokens are truncated from the left (keeps the end, which the "
        "completion continues). None = no truncation.",
        ge=1,
    )
    shuffle_dataset: bool = F(True, "Shuffle prompts each epoch (seeded by `seed`).")

    # ---------------------------------------------------------------- core RLOO
    num_generations: int = F(
        2,
        "G, completions sampled per prompt. The leave-one-out baseline of each completion is the mean "
        "reward of the other G-1, so G >= 2. Larger G lowers baseline variance at G x the sampling cost.",
    )
    beta: float = F(
        0.05,
        "KL coefficient: reward r_i = R(o_i) - beta * KL_i. 0 disables the KL penalty and the reference "
        "model is not loaded at all (saves memory).",
        ge=0.0,
    )
    router_aux_loss_coef: float | None = F(
        None,
        "Mixture-of-Experts policies: weight of the router's load-balancing loss added to the RLOO loss (logged as "
        "`aux_loss`). None = the architecture's own coefficient (`router_aux_loss_coef` in the model config; 0 when it "
        "declares none); 0 = off. Set on a model that is not a Mixture of Experts, it is refused (as in TRL).",
    )
    epsilon: float = F(0.2, "Lower clip range of the sequence ratio: ratio is clipped to [1 - epsilon, 1 + epsilon_high].")
    epsilon_high: float | None = F(None, "Upper clip range; None = same as `epsilon` (set higher for DAPO-style clip-higher).")
    num_iterations: int = F(
        1,
        "Times each generation batch is reused for optimisation (mu in the GRPO/RLOO papers). 1 = on-policy; "
        ">1 reuses samples and makes the ratio clipping matter.",
        ge=1,
    )
    steps_per_generation: int | None = F(
        None,
        "Micro-batches per generation batch. None = `gradient_accumulation_steps` (one generation per "
        "optimizer step). Mutually exclusive with `generation_batch_size`.",
        ge=1,
    )
    generation_batch_size: int | None = F(
        None,
        "Completions per generation, summed over processes; must be a multiple of "
        "`per_device_train_batch_size * num_processes` and of `num_generations`. Mutually exclusive with "
        "`steps_per_generation`.",
        ge=1,
    )

    # ---------------------------------------------------------------- advantages and rewards
    normalize_advantages: bool = F(
        False, "Divide advantages by their standard deviation over the generation batch. The RLOO paper does not."
    )
    reward_clip_range: tuple[float, float] | None = F(
        None, "Clip each source's reward to [low, high] before weighting. None = no clipping."
    )
    reward_source_max_empty_steps: int = F(
        2,
        "Fail (RewardError naming the source) once a reward source has scored none of a process's completions "
        "(every value None or NaN) for this many generation batches in a row; each such batch is warned about on "
        "stderr. A source that never scores adds no signal: alone it leaves every advantage 0, so training "
        "\"succeeds\" without learning; beside other sources it is silently ignored. 2 catches a broken function "
        "in the first two steps; raise it for a source that legitimately abstains for a while; 0 = only warn.",
        ge=0,
    )
    mask_truncated_completions: bool = F(
        False,
        "Exclude completions that hit `max_completion_length` without an EOS from the loss (they get no "
        "gradient). Recommended when truncation is common, since their reward judges an unfinished answer.",
    )

    # ---------------------------------------------------------------- sampling
    max_completion_length: int = F(512, "Maximum tokens sampled per completion (TRL's default).", ge=1)
    temperature: float = F(1.0, "Sampling temperature; log-probs are computed from logits scaled by it too.", gt=0.0)
    top_p: float = F(1.0, "Nucleus sampling mass; 1.0 = off. With vLLM, its log-probs of the truncated distribution "
                     "are put back on the trainer's full-distribution scale before the ratio and the importance "
                     "weights use them (docs/architecture.md, \"Truncated sampling\"); top_k and min_p the same.",
                     gt=0.0, le=1.0)
    top_k: int | None = F(None, "Top-k sampling; None or 0 = off.", ge=0)
    min_p: float | None = F(None, "Min-p sampling threshold; None = off.", ge=0.0, le=1.0)
    repetition_penalty: float = F(1.0, "Repetition penalty for sampling; 1.0 = off.", gt=0.0)
    sampling_logprobs: Literal["auto", "generation", "forward"] = F(
        "auto",
        "Where the sampling policy's per-token log-probs (the KL term with `beta > 0`, and the old "
        "log-probs off-policy) come from. `generation`: recorded while decoding, from the logits the "
        "sample was drawn from (no extra forward pass). `forward`: a separate no-grad forward over the "
        "whole batch. In fp32 the two agree to ~1e-6 per token. In bf16/fp16 the KV-cached decoding "
        "logits differ from a full forward by ~1e-3 per token (measured on a tiny model; more on large "
        "ones), so step-1 KL would start above 0 and off-policy ratios away from 1. Generate-time logits processors "
        "(`min_new_tokens`, `suppress_tokens`, `no_repeat_ngram_size`, ... in `generation_kwargs` or the model's "
        "generation_config) change the logits a token was drawn from, which a forward cannot see. `auto` = "
        "`generation` in fp32 with the HF backend, no repetition penalty and no such processor, else `forward`; "
        "`generation` with a processor is refused.",
    )
    chunked_logprobs: bool = F(
        False,
        "Compute per-token log-probs from the final hidden states a chunk of positions at a time, recomputing "
        "each chunk's logits in the backward pass, so the (batch, completion, vocabulary) logits never exist. "
        "A memory lever that costs time, less worth it since the full-logits path writes the logits' gradient "
        "over them (bench/README.md, round 3): on 2 CPU cores at 8-token prompts, 16 x 64 completion tokens, "
        "vocabulary 152k, a whole step's peak RSS went 0.91x -> 0.87x TRL's at hidden 512 / 8 layers and 0.82x -> "
        "0.76x at hidden 256 / 4, the step 31-36% slower. Before that (the full logits kept as float32 copies) one "
        "update on a hidden-512 8-layer model took 230-320 MiB less peak RSS and 9-20% longer at 32k vocabulary. "
        "It pays only where micro-batch tokens x vocabulary outweighs "
        "vocabulary x hidden (the head's weight gradient, which both paths make): in `bench/chunked_logprobs_memory.py` "
        "at 152k vocabulary and 16 x 32 tokens the log-prob step's peak was 0.49x (hidden 512), 0.83x (2048) and "
        "0.85x (4096) of the full logits', but 1.01-1.12x (no gain) at 16 x 8 tokens or a 32k vocabulary, with "
        "short completions. Not measured on GPU. Heads it cannot reproduce (LoRA on `lm_head`, ZeRO-3, "
        "soft-capped or scaled logits) use the full logits anyway.",
    )
    share_prompt_forward: bool = F(
        True,
        "Run each distinct prompt once in the log-prob passes (reference, sampling policy), in the training "
        "forward and backward, and in a decoder reward model (its common prompt tokens), the KV cache shared by "
        "the G completions, instead of G times (`rloo_engine/prompt_sharing.py`). The same log-probs, "
        "gradients and scores up to rounding (~1e-6 in fp32), with (G-1)/G of the prompt tokens' compute "
        "saved; bench/README.md has what it measured per shape. An encoder reward model (RoBERTa) scores "
        "whole rows. "
        "Checked at start-up on a probe batch: a model it does not reproduce (another cache layout) uses the "
        "plain forward, with a message. Off for the training forward under `gradient_checkpointing`, which "
        "drops the cache.",
    )
    fused_decode: bool = F(
        True,
        "Decode with the engine's own loop for float32 Qwen2-, Qwen3-, Llama- and Mistral-shaped models (`rloo_engine/generation/fused_decode.py`): "
        "q/k/v and gate/up packed into one matmul each, ~15 tensor ops a layer per token instead of transformers' "
        "~50, the same sampling, stopping and recorded log-probs as HF `generate` (the same tokens up to float32 "
        "rounding). It pays where per-op overhead dominates a decode step: on 2 CPU cores a generation call took "
        "31-33% less time at hidden 256 / 4 layers, 4-9% at hidden 512 / 8 layers (bench/README.md). Other models, dtypes, generation_kwargs, "
        "a repetition penalty or logits processors from the model's generation_config decode with `generate`; so "
        "does a model whose decode step differs from its own forward on a probe batch at the first generation (with "
        "a message). HF backend only.",
    )
    generation_dtype: Literal["auto", "bfloat16"] = F(
        "auto",
        "The precision the HF backend samples in. `auto`: the policy's own. `bfloat16`: a float32 policy decodes in "
        "the fused loop (`fused_decode`) on bfloat16 copies of its matmul weights, about 2x faster where decoding "
        "streams its weights from memory and bf16 matmuls are fast (CPUs with AMX or AVX512-BF16, GPUs): on the "
        "2-core CPU of bench/README.md, 1.95x per completion token at hidden 512 / 8 layers. The samples then come "
        "from the bf16 policy, close to but not exactly pi_old: the KL and pi_old come from the trainer's float32 "
        "forward (the training forward's own where a generation batch is one micro-batch, so no pass is added), the "
        "decoding log-probs are compared with them (`bf16_decoding/logprob_diff_mean`, `_max`) and, with "
        "`vllm_importance_sampling_correction: true`, weight the update by pi_old / pi_bf16 as vLLM's do. Models the "
        "fused loop does not cover sample in the policy's dtype, with a message. Not in TRL (its HF path samples in "
        "the policy's dtype); HF backend only.",
    )
    ratio_anchor: Literal["auto", "old_policy", "vllm"] = F(
        "auto",
        "What the PPO ratio rho is taken against. `old_policy` (TRL's): rho = pi_theta / pi_old, the trainer's "
        "own log-probs at the sampling weights, and the importance weights pi_old / pi_vllm multiply the "
        "gradient. With one update per batch (`num_iterations: 1`) rho is then 1 and the clip never acts, so "
        "nothing bounds how far a step moves the policy from the weights that sampled the batch. `vllm`: rho = "
        "pi_theta / pi_vllm, vLLM's log-probs of the sampled tokens, so the clip [1 - `epsilon`, 1 + "
        "`epsilon_high`] is a trust region around the (possibly stale) sampling policy, and the importance "
        "weights act as a mask only: a completion (`sequence_mask`) or token (`token_mask`) whose weight leaves "
        "[`vllm_importance_sampling_clip_min`, `vllm_importance_sampling_clip_max`] gets no gradient. Needs "
        "`vllm_importance_sampling_correction: true` and a `*_mask` mode. `auto` = `vllm` with "
        "`async_generation` and `max_staleness` >= 1 and a `*_mask` mode (on the CPU demo bench, 6 seeds, it removed "
        "the mid-run dips of one-step off-policy training: bench/README.md), else `old_policy`. Not in TRL.",
    )
    async_generation: bool = F(
        False,
        "Server mode: generate the next batch while the policy updates on this one (one-step off-policy, as veRL "
        "and OpenRLHF offer), so the server and the trainer compute at the same time. Batch k+1 is sampled from "
        "the weights batch k started from; `vllm_importance_sampling_correction` (required) weights each "
        "completion by pi_old / pi_vllm, which then covers the staleness as well as vLLM's numerics, and "
        "`async/staleness` logs the optimizer steps between the weights that sampled a batch and those it is "
        "first trained on. `timing/generation_s` becomes the time the trainer waited for the server. Needs "
        "`use_vllm: true` and `vllm_mode: server`. With `ratio_anchor: auto` the PPO ratio is then taken against "
        "vLLM's log-probs (a trust region around the stale sampling weights): on the CPU demo bench (6 seeds) the "
        "reward then tracks synchronous training along the whole curve; with pi_old's anchor it dipped mid-run "
        "(bench/README.md). Watch `completions/clipped_ratio` and `sequence_kl`.",
    )
    max_staleness: int = F(
        1,
        "With `async_generation`: how many generation batches the server may run ahead of the trainer. 1: batch "
        "k+1 generates during the update on batch k. 0: no overlap, the same run as without "
        "`async_generation`. At most 1: the server holds one set of weights and takes new ones only between "
        "batches.",
        ge=0,
        le=1,
    )
    generation_kwargs: dict[str, Any] = F({}, "Extra keyword arguments for the generation backend (override the above).")
    chat_template_kwargs: dict[str, Any] = F(
        {}, "Extra keyword arguments for `apply_chat_template` on conversational prompts (e.g. `enable_thinking`)."
    )

    # ---------------------------------------------------------------- optimisation
    learning_rate: float = F(1e-6, "Peak AdamW learning rate. RLHF fine-tuning wants small values (1e-6 to 1e-5).", gt=0.0)
    lr_scheduler_type: str = F("linear", "transformers scheduler name: linear, cosine, constant, constant_with_warmup, ...")
    warmup_steps: int = F(0, "Linear warmup in optimizer steps. Overrides `warmup_ratio` when > 0.", ge=0)
    warmup_ratio: float = F(0.0, "Warmup as a fraction of the total optimizer steps.", ge=0.0, le=1.0)
    weight_decay: float = F(
        0.0, "Weight decay of the weights; biases and normalisation layers get none, as in transformers' Trainer.",
        ge=0.0)
    adam_beta1: float = F(0.9, "AdamW beta1.", ge=0.0, lt=1.0)
    adam_beta2: float = F(0.999, "AdamW beta2.", ge=0.0, lt=1.0)
    max_grad_norm: float | None = F(1.0, "Gradient clipping norm; None or 0 = no clipping.", ge=0.0)
    per_device_train_batch_size: int = F(
        8, "Completions (not prompts) per micro-batch per process, as in TRL.", ge=1
    )
    gradient_accumulation_steps: int = F(1, "Micro-batches accumulated per optimizer step.", ge=1)
    max_steps: int = F(-1, "Total optimizer steps. -1 = derive from `num_train_epochs` and the dataset size.", ge=-1)
    num_train_epochs: float = F(
        3.0, "Passes over the prompt dataset when `max_steps` is -1 (TRL's default, 3; a fraction stops part-way).",
        gt=0.0)

    # ---------------------------------------------------------------- optimiser and scheduler (TRL/transformers names)
    optim: Literal["adamw_torch_fused", "adamw_torch", "adafactor"] = F(
        "adamw_torch_fused",
        "Optimizer, by transformers' names. `adamw_torch_fused` (transformers' default from torch 2.8, so TRL's): "
        "`torch.optim.AdamW(fused=True)`, on CPU as well as CUDA (one CPU step of a 31.7M-parameter model took 37 ms "
        "against 133 for `adamw_torch`'s per-tensor loop, bench/README.md); on a device without the fused kernel it "
        "says so once and uses `adamw_torch`. `adamw_torch`: `torch.optim.AdamW` (foreach). `adafactor`: "
        "`transformers.optimization.Adafactor` with `learning_rate` as its fixed step size (`scale_parameter` and "
        "`relative_step` off, as transformers' Trainer), beta1 off; `adam_*` do not apply. Others (8-bit, paged, "
        "GaLore, ...) are refused.",
    )
    adam_epsilon: float = F(1e-8, "AdamW epsilon (transformers' default).", gt=0.0)
    lr_scheduler_kwargs: dict[str, Any] = F(
        {},
        "Extra keyword arguments of the `lr_scheduler_type` schedule (transformers' `scheduler_specific_kwargs`), "
        "e.g. `{\"num_cycles\": 2}` for `cosine_with_restarts`, `{\"min_lr_rate\": 0.1}` for `cosine_with_min_lr`, "
        "`{\"power\": 2.0}` for `polynomial`. Checked against the schedule's parameters when the config loads.",
    )

    # ---------------------------------------------------------------- precision and memory
    bf16: bool = F(
        False, "bfloat16 mixed precision through accelerate (GPUs with bf16 support). TRL's default is true; false "
        "here, so one config runs on CPU and GPU alike and keeps the float32 fast paths; a run that leaves it unset "
        "says so on stderr.")
    fp16: bool = F(False, "float16 mixed precision with loss scaling through accelerate.")
    gradient_checkpointing: bool = F(
        False, "Recompute activations in backward to save memory (~20-30% slower; the shared-prompt training forward "
        "is off with it). TRL's default is true; false here, as it changes time and memory, not the gradients; a run "
        "that leaves it unset says so on stderr.")
    disable_dropout: bool = F(
        False, "Set every dropout probability to 0 in policy and reference (LoRA's `lora_dropout` too), so log-probs "
        "are deterministic. TRL's default, false: most current models have no dropout anyway; set it for one that does.")

    # ---------------------------------------------------------------- bookkeeping
    seed: int = F(42, "Seed for python, numpy and torch RNGs, data order and sampling.")
    output_dir: str = F("outputs/rloo", "Where checkpoints, `metrics.jsonl`, completion tables and `final/` are written.")
    run_name: str | None = F(None, "Name of the MLflow run when the engine creates one.")
    logging_steps: int = F(10, "Write metrics every this many optimizer steps.", ge=1)
    report_to: Annotated[list[Literal["all", "none", "mlflow", "tensorboard", "wandb"]], BeforeValidator(_tracker_list)] = F(
        ["mlflow"],
        "Trackers that get each logging step's metrics (rank 0), as TRL's `report_to`: `mlflow`, `tensorboard` "
        "(event files in `output_dir/runs/`), `wandb` (project `WANDB_PROJECT`, default `huggingface`, files under "
        "`output_dir/wandb/`; `WANDB_MODE=offline` keeps them local), a list of them, `all` (each of the three that "
        "is installed) or `none`. `metrics.jsonl` is written whatever this says. MLflow logs only when "
        "`MLFLOW_TRACKING_URI` or `MLFLOW_RUN_ID` names a server, and not at all when `mlflow` is left out, even "
        "then. The default is `mlflow` where transformers 5 says `none`: MLflow is this project's tracker, and "
        "without its environment variables it stays off.",
    )
    save_steps: int = F(500, "Write `checkpoint-N` every this many optimizer steps; 0 = only the final model.", ge=0)
    save_total_limit: int | None = F(None, "Keep at most this many checkpoints (oldest pruned). None = keep all.", ge=1)
    save_merged_model: bool = F(
        False,
        "With `use_peft`: also write `final-merged/`, the adapters merged into the base (a plain causal LM for "
        "`AutoModelForCausalLM`, vLLM or MLflow serving). `final/` holds the adapter in PEFT layout either way, as "
        "TRL saves it. The pipeline sets it for LoRA runs: it evaluates and registers the merged copy.",
    )
    resume_from_checkpoint: str | None = F(
        None, "`latest` (newest complete `checkpoint-N` in `output_dir`, or a fresh start if none; a damaged one is "
        "named on stderr and skipped), or a checkpoint path (must be complete, else a config error, exit 2). Every file "
        "a resume reads is validated before anything loads.",
    )
    overwrite_output_dir: bool = F(
        False,
        "Delete what an earlier run left in `output_dir` (its `checkpoint-N`, `final/`, `metrics.jsonl`, "
        "`completions.jsonl`) before training. Without it a fresh run into a directory holding another run's outputs "
        "is refused, naming them, before anything is touched. Cannot be combined with `resume_from_checkpoint`.",
    )
    disable_tqdm: bool = F(False, "Hide the progress bar (rank 0 shows one by default).")

    # ---------------------------------------------------------------- logging verbosity (TRL/transformers names)
    logging_first_step: bool = F(
        False, "Also write the metrics of optimizer step 1, before the first `logging_steps` window closes."
    )
    log_level: Literal["debug", "info", "warning", "error", "critical", "passive"] = F(
        "passive",
        "transformers' logging level on the main process (as TrainingArguments' `log_level`; other processes keep "
        "`warning`). `passive` leaves it as it is (transformers' own default: warning).",
    )

    # ---------------------------------------------------------------- reference-model sync
    sync_ref_model: bool = F(
        False, "Periodically move the reference towards the policy (TR-DPO style): ref = alpha*policy + (1-alpha)*ref. "
        "Needs a separate reference: rejected with `use_peft` or `beta: 0`, as TRL does. Works under ZeRO-3 (gathered).",
    )
    ref_model_mixup_alpha: float = F(0.6, "alpha of the reference sync.", ge=0.0, le=1.0)
    ref_model_sync_steps: int = F(512, "Optimizer steps between reference syncs.", ge=1)

    # ---------------------------------------------------------------- logging samples
    log_completions: bool = F(False, "Print sample completions at each logging step and save them to `completions.jsonl`.")
    log_multimodal: bool = F(True, "With `log_completions` and prompts with images: save each logged prompt's images (`completion_images/step-N/`), name them in `completions.jsonl` (`images`) and show them in the MLflow completions table (`image`). false keeps the logs small with high-resolution images.")
    num_completions_to_print: int | None = F(None, "Rows printed per logging step; None = all of the batch's first group.", ge=1)

    # ---------------------------------------------------------------- validation
    @model_validator(mode="after")
    def _check(self) -> RLOOConfig:
        g = self.num_generations
        if g < 2:
            raise ValueError(
                f"num_generations: {g}; RLOO needs at least 2 completions per prompt for the leave-one-out baseline"
            )
        if self.epsilon <= 0:
            raise ValueError(f"epsilon: {self.epsilon}; expected > 0")
        if self.epsilon_high is not None and self.epsilon_high <= 0:
            raise ValueError(f"epsilon_high: {self.epsilon_high}; expected > 0 or null")
        if self.steps_per_generation is not None and self.generation_batch_size is not None:
            raise ValueError(
                "steps_per_generation and generation_batch_size: both set "
                f"({self.steps_per_generation}, {self.generation_batch_size}); set at most one"
            )
        if self.generation_batch_size is not None:
            gbs = self.generation_batch_size
            if gbs % g:
                raise ValueError(f"generation_batch_size: {gbs} is not divisible by num_generations={g}")
            if gbs % self.per_device_train_batch_size:
                raise ValueError(
                    f"generation_batch_size: {gbs} is not divisible by "
                    f"per_device_train_batch_size={self.per_device_train_batch_size}"
                )
        else:
            per_device = self.per_device_train_batch_size * self.effective_steps_per_generation
            if per_device % g:
                raise ValueError(
                    f"per_device_train_batch_size * steps_per_generation = {per_device} completions per "
                    f"generation batch is not divisible by num_generations={g}; each prompt's G completions "
                    "must stay together on one process"
                )
        if self.model_name_or_path is not None:
            check_model_source("model_name_or_path", self.model_name_or_path)
        if self.reward_model_name_or_path:
            check_model_source("reward_model_name_or_path", self.reward_model_name_or_path)
        for f in self.reward_funcs:
            if ":" not in f:
                raise ValueError(f"reward_funcs: {f!r}; expected an import path like 'my_pkg.rewards:length_reward'")
        self._check_eval(g)
        if self.reward_clip_range is not None and self.reward_clip_range[0] >= self.reward_clip_range[1]:
            raise ValueError(f"reward_clip_range: {list(self.reward_clip_range)}; expected [low, high] with low < high")
        if self.vllm_server_base_url is not None and not self.vllm_server_base_url.startswith(("http://", "https://")):
            raise ValueError(f"vllm_server_base_url: {self.vllm_server_base_url!r}; expected an http:// or https:// "
                             "URL such as http://127.0.0.1:8000")
        if self.generation_dtype != "auto":
            self._check_generation_dtype()
        if self.vllm_importance_sampling_correction:
            self._check_importance_sampling()
        if self.async_generation:
            self._check_async_generation()
        if self.ratio_anchor == "vllm":
            self._check_vllm_ratio_anchor()
        if self.bf16 and self.fp16:
            raise ValueError("bf16 and fp16: both true; choose one mixed-precision mode")
        if self.sync_ref_model and (self.use_peft or self.beta == 0):
            # As TRL: with LoRA the reference is the adapter-free base, and with beta 0 there is none.
            why = "use_peft: true (the reference is the adapter-disabled base)" if self.use_peft else "beta: 0 (no reference)"
            raise ValueError(f"sync_ref_model: true has nothing to sync with {why}; set sync_ref_model: false")
        if self.save_merged_model and not self.use_peft:
            raise ValueError("save_merged_model: true without use_peft; only a LoRA run has adapters to merge, "
                             "and `final/` already holds the whole model")
        self._check_report_to()
        if self.overwrite_output_dir and self.resume_from_checkpoint:
            raise ValueError(
                f"overwrite_output_dir: true with resume_from_checkpoint: {self.resume_from_checkpoint!r}; either "
                "continue the run in output_dir or delete it, not both"
            )
        if self.lr_scheduler_type not in _SCHEDULERS:
            raise ValueError(f"lr_scheduler_type: {self.lr_scheduler_type!r}; expected one of {sorted(_SCHEDULERS)}")
        self._check_trl_model_options()
        return self

    def check_inputs(self, reward_sources: int | None = None, has_dataset: bool | None = None,
                     has_model: bool | None = None) -> None:
        """ConfigError unless the run has a policy, prompts and reward sources (one weight each), as the config names
        them or (`RLOOTrainer`) its arguments give them."""
        if not (self.model_name_or_path is not None if has_model is None else has_model):
            raise ConfigError("model_name_or_path: not set; expected a local model directory or a hub id")
        if not (self.dataset_name is not None if has_dataset is None else has_dataset):
            raise ConfigError("dataset_name: not set; expected a hub id, dataset directory or data file")
        n = len(self.reward_funcs) + bool(self.reward_model_name_or_path) if reward_sources is None else reward_sources
        if n == 0:
            raise ConfigError("reward_model_name_or_path / reward_funcs: neither is set; give a reward model or at "
                              "least one reward function")
        if self.reward_weights is not None and len(self.reward_weights) != n:
            raise ConfigError(f"reward_weights: {self.reward_weights} has {len(self.reward_weights)} entries; "
                              f"expected {n}, one per reward source (reward model first, then each of reward_funcs)")

    def _check_report_to(self) -> None:
        if len(self.report_to) > 1 and {"all", "none"} & set(self.report_to):
            raise ValueError(f"report_to: {self.report_to}; `all` and `none` stand alone, not in a list")
        for name in set(self.report_to) - {"all", "mlflow"}:
            if importlib.util.find_spec(name) is None:
                raise ValueError(f"report_to: {name}, but the {name} package is not installed; "
                                 "pip install 'rloo-pipeline[trackers]'")

    def trackers(self) -> list[str]:
        """The trackers `report_to` names, with `all` resolved to the installed ones."""
        if self.report_to == ["all"]:
            return [n for n in ("mlflow", "tensorboard", "wandb") if importlib.util.find_spec(n) is not None]
        return list(self.report_to)

    def _check_async_generation(self) -> None:
        if not (self.use_vllm and self.vllm_mode == "server"):
            raise ValueError(
                f"async_generation: true with use_vllm: {str(self.use_vllm).lower()}, vllm_mode: {self.vllm_mode!r}; "
                "it overlaps a vLLM server's generation with the update, so it needs use_vllm: true and "
                "vllm_mode: server"
            )
        if self.max_staleness > 0 and not self.vllm_importance_sampling_correction:
            raise ValueError(
                f"async_generation: true with max_staleness: {self.max_staleness} and "
                "vllm_importance_sampling_correction: false; batches are sampled from weights up to "
                f"{self.max_staleness} step(s) old, and only the importance weights correct the update for it; "
                "set vllm_importance_sampling_correction: true (or max_staleness: 0)"
            )

    def _check_vllm_ratio_anchor(self) -> None:
        if not self.vllm_importance_sampling_correction:
            raise ValueError(
                "ratio_anchor: 'vllm' with vllm_importance_sampling_correction: false; the ratio is taken against "
                "vLLM's log-probs and the importance weights mask what gets no gradient, so set "
                "vllm_importance_sampling_correction: true (and use_vllm: true), or ratio_anchor: old_policy"
            )
        if not self.vllm_importance_sampling_mode.endswith("mask"):
            raise ValueError(
                f"ratio_anchor: 'vllm' with vllm_importance_sampling_mode: {self.vllm_importance_sampling_mode!r}; "
                "against vLLM's log-probs the clip already bounds the ratio and the weights only mask, so expected "
                "'sequence_mask' or 'token_mask' (or ratio_anchor: old_policy)"
            )

    def _check_generation_dtype(self) -> None:
        value = f"generation_dtype: {self.generation_dtype!r}"
        if self.use_vllm:
            raise ValueError(f"{value} with use_vllm: true; vLLM samples in its own dtype (the model's, `dtype`); "
                             "generation_dtype is the HF backend's, so set generation_dtype: auto")
        if self.dtype != "float32" or self.bf16 or self.fp16:
            raise ValueError(f"{value} with dtype: {self.dtype}, bf16: {str(self.bf16).lower()}, fp16: "
                             f"{str(self.fp16).lower()}; it decodes a float32 policy in bfloat16, and this policy "
                             "already samples in half precision: set generation_dtype: auto")
        if self.sampling_logprobs == "generation":
            raise ValueError(f"{value} with sampling_logprobs: 'generation'; the bf16 decoding log-probs are not the "
                             "float32 policy's pi_old: use sampling_logprobs: auto (the trainer's forward gives them)")

    def _check_importance_sampling(self) -> None:
        if not self.use_vllm and self.generation_dtype == "auto":
            raise ValueError(
                "vllm_importance_sampling_correction: true without use_vllm: true or generation_dtype: bfloat16; the "
                "weights correct for a sampler other than the trainer's policy, and the HF backend samples from the "
                "trainer's own policy"
            )
        low, high = self.vllm_importance_sampling_clip_min, self.vllm_importance_sampling_clip_max
        if low is not None and high is not None and low >= high:
            raise ValueError(
                f"vllm_importance_sampling_clip_min: {low} is not below vllm_importance_sampling_clip_max: {high}"
            )
        if self.vllm_importance_sampling_mode.endswith("truncate") and low is None and high is None:
            raise ValueError(
                f"vllm_importance_sampling_mode: {self.vllm_importance_sampling_mode!r} with neither "
                "vllm_importance_sampling_clip_min nor vllm_importance_sampling_clip_max set; a truncation needs a bound"
            )

    # ---------------------------------------------------------------- derived values
    @property
    def logprobs_from_generation(self) -> bool:
        """Whether `sampling_logprobs` resolves to the decoding log-probs (see its description)."""
        if self.sampling_logprobs != "auto":
            return self.sampling_logprobs == "generation"
        full_precision = not (self.bf16 or self.fp16) and self.dtype == "float32" and self.generation_dtype == "auto"
        return full_precision and not self.use_vllm and self.repetition_penalty == 1.0

    @property
    def vllm_server_url(self) -> str:
        """Server mode: where the vLLM server answers."""
        return (self.vllm_server_base_url or f"http://{self.vllm_server_host}:{self.vllm_server_port}").rstrip("/")

    @property
    def effective_ratio_anchor(self) -> str:
        """`ratio_anchor` with `auto` resolved (see its description)."""
        if self.ratio_anchor != "auto":
            return self.ratio_anchor
        stale = self.async_generation and self.max_staleness > 0 and self.vllm_importance_sampling_correction
        return "vllm" if stale and self.vllm_importance_sampling_mode.endswith("mask") else "old_policy"

    @property
    def effective_epsilon_high(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high

    @property
    def effective_steps_per_generation(self) -> int:
        """Micro-batches per generation batch when `generation_batch_size` is not set."""
        return self.steps_per_generation or self.gradient_accumulation_steps

    def total_steps_for(self, dataset_size: int, num_processes: int) -> int:
        """Optimizer steps of the run: `max_steps`, else `num_train_epochs` over a dataset of `dataset_size` prompts."""
        if self.max_steps > 0:
            return self.max_steps
        prompts_per_step = (self.per_device_train_batch_size * self.gradient_accumulation_steps * num_processes
                            / self.num_generations / self.num_iterations)
        return max(1, math.ceil(self.num_train_epochs * dataset_size / prompts_per_step))

    def steps_per_generation_for(self, num_processes: int) -> int:
        """Micro-batches per generation batch on each process, for a run with `num_processes`."""
        if self.generation_batch_size is None:
            return self.effective_steps_per_generation
        per_step = self.per_device_train_batch_size * num_processes
        if self.generation_batch_size % per_step:
            raise ConfigError(
                f"generation_batch_size: {self.generation_batch_size} is not divisible by "
                f"per_device_train_batch_size * num_processes = {per_step}"
            )
        spg = self.generation_batch_size // per_step
        if (spg * self.per_device_train_batch_size) % self.num_generations:
            raise ConfigError(
                f"generation_batch_size: {self.generation_batch_size} gives {spg * self.per_device_train_batch_size} "
                f"completions per process, not divisible by num_generations={self.num_generations}"
            )
        return spg

    @property
    def has_reference_model(self) -> bool:
        return self.beta > 0


# A hub id is `name` or `owner/name` of letters, digits, `-`, `_`, `.`; anything else is meant as a path.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")


def check_model_source(field: str, value: str) -> None:
    """Decides "local directory or hub id" from the string alone, before any hub or model code runs.

    An existing path is local and must be a directory. A string shaped like a hub id (`gpt2`,
    `Qwen/Qwen2.5-0.5B`) is left to the hub. Anything else (`/ckpt/sft`, `./out/final`, `~/m`,
    `runs/1/train/final`) is a path that does not exist, reported as such instead of as a bad repo id.
    """
    if not value.strip():
        raise ValueError(f"{field}: empty; expected a local model directory or a hub id like 'org/name'")
    path = Path(value).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ValueError(f"{field}: {value} is a file; expected a model directory in save_pretrained format")
        return
    if value.startswith(("/", ".", "~")) or not _HUB_ID.match(value):
        raise ValueError(
            f"{field}: local path {value} does not exist; expected a model directory in save_pretrained format "
            "or a hub id like 'org/name'"
        )


_SCHEDULERS = {
    "linear", "cosine", "cosine_with_restarts", "polynomial", "constant",
    "constant_with_warmup", "inverse_sqrt", "cosine_with_min_lr", "warmup_stable_decay",
}


def build_config(values: dict[str, Any], source: str = "RLOOConfig") -> RLOOConfig:
    """Validates `values` into an RLOOConfig, raising ConfigError with every problem named."""
    cfg = validated(RLOOConfig, values, source)
    try:
        cfg.check_inputs()
    except ConfigError as err:
        raise ConfigError(f"{source}: {err}") from None
    return cfg


def save_config(cfg: RLOOConfig, path: str | Path) -> Path:
    """Writes the config as YAML (only non-derived fields), so a run can be reproduced with `--config`."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
    return p
