"""The RLOO trainer: an explicit accelerate loop (generate -> score -> advantages -> loss -> step -> log -> save).

Read `train()` top to bottom for the whole algorithm. Groups of G completions never cross a process:
each process samples its own prompts, so the leave-one-out baseline needs no communication.
"""

from __future__ import annotations

import sys
import time
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from accelerate.utils import set_seed

from rloo_engine import algorithm as A
from rloo_engine.batch import GenerationBatch, generation_metrics
from rloo_engine.callbacks import EngineCallbacks
from rloo_engine.config import RLOOConfig, save_config
from rloo_engine.config_base import ConfigError
from rloo_engine.data import PromptSampler, as_assistant_messages, extra_columns, render_prompt
from rloo_engine.distributed import (
    build_accelerator,
    fill_deepspeed_config,
    full_weights_for_generation,
    gathered_for_update,
    global_grad_norm,
    loads_weights,
    prepare_frozen_model,
    weights_for_sync,
)
from rloo_engine.eval_during_training import PeriodicEvaluation
from rloo_engine.fast_path import is_half_precision
from rloo_engine.generation.base import GenerationBackend, SamplingParams
from rloo_engine.generation.factory import build_backend
from rloo_engine.generation.hf import record_decoding_logprobs
from rloo_engine.logprobs import (
    batched_token_logps,
    batched_truncated_token_logps,
    completion_token_logps,
    probed_fast_paths,
)
from rloo_engine.machine_flags import settle_machine_flags
from rloo_engine.metrics import MetricsLogger
from rloo_engine.models import (
    RouterAuxLoss,
    eos_token_ids,
    has_active_dropout,
    hub_kwargs,
    load_policy,
    load_reference,
    reference_context,
    sync_reference,
)
from rloo_engine.optim import build_optimizer, build_scheduler, parameter_groups
from rloo_engine.progress import format_metric, metric_line, progress_bar
from rloo_engine.prompt_feed import PromptFeed
from rloo_engine.prompt_stream import StreamedPrompts, StreamSampler
from rloo_engine.reward_context import RewardContext
from rloo_engine.reward_sources import EmptySourceWatch, RewardModelSource, build_reward_sources, compute_rewards
from rloo_engine.run import checkpoint as ckpt
from rloo_engine.run.claim import claim_output_dir, start_point
from rloo_engine.run.fault_injection import crash, crash_step, maybe_kill
from rloo_engine.run.preflight import check_completion_fits, model_position_limit, prompt_token_budget
from rloo_engine.trainer_bookkeeping import TrainerBookkeeping
from rloo_engine.trainer_inputs import eval_prompts, prepared_tokenizer, resolve_trainer_arguments, train_prompts
from rloo_engine.vision import vision_processor


@dataclass
class TrainResult:
    global_step: int
    final_dir: Path | None
    metrics_path: Path
    last_metrics: dict[str, float]
    mlflow_run_id: str | None = None  # the run metrics went to (rank 0), whether given or created


class RLOOTrainer(TrainerBookkeeping):
    """TRL's signature: `RLOOTrainer(model=..., reward_funcs=..., args=RLOOConfig(...), train_dataset=...)` (each
    argument as TRL takes it, `trainer_inputs.py`), or `RLOOTrainer(cfg)` with everything named in the config."""

    def __init__(self, model=None, reward_funcs=None, args: RLOOConfig | None = None, train_dataset=None,
                 eval_dataset=None, processing_class=None, reward_processing_classes=None, callbacks=None,
                 optimizers=(None, None), peft_config=None, *, backend: GenerationBackend | None = None):
        if optimizers != (None, None):
            raise ConfigError("optimizers: custom optimizer objects are not taken; the engine builds its optimizer "
                              "and schedule from the config (optim, learning_rate, lr_scheduler_type, ...)")
        cfg, self.inputs = resolve_trainer_arguments(model, reward_funcs, args, train_dataset, eval_dataset,
                                                     processing_class, reward_processing_classes, callbacks,
                                                     peft_config)
        self.cfg = self.args = cfg
        self.acc = build_accelerator(cfg)
        for line in self.inputs.unset_differences:
            self._say(line)
        settle_machine_flags(cfg, self.acc, self._say)  # tf32, log_level, GPU-only options, a DeepSpeed JSON
        # Before anything loads: reward imports, tokenizer sizes, output_dir, this run's lock, the checkpoint.
        # `RLOOTrainer(cfg)` decides where it starts now (its config says); TRL's form in train(resume_from_checkpoint).
        self.start_decided = self.inputs.config_only
        self.run_lock, self.resume_path = claim_output_dir(cfg, self.acc, self.inputs.describe(),
                                                           decide_start=self.start_decided)
        self.steps_per_generation = cfg.steps_per_generation_for(self.acc.num_processes)
        self.on_policy = cfg.num_iterations == 1 and cfg.gradient_accumulation_steps % self.steps_per_generation == 0
        self._deferred_advantages: dict | None = None  # what `loss` needs to finish the batch's advantages
        set_seed(cfg.seed)
        # Cheap checks first: a bad dataset or reward function fails before any model is loaded.
        self.dataset = train_prompts(cfg, self.inputs)  # a Dataset, or a stream (IterableDataset)
        self.dataset_size = None if isinstance(self.dataset, StreamedPrompts) else len(self.dataset)
        eval_datasets = eval_prompts(cfg, self.inputs)
        given = self.inputs.policy
        self.processor = vision_processor(self.inputs.tokenizer, cfg, given, self.dataset, self._say)  # None: text
        self.tokenizer = prepared_tokenizer(self.processor or self.inputs.tokenizer, cfg, given)
        self.model_eos_ids = eos_token_ids(self.tokenizer, cfg.model_name_or_path, cfg.model_revision,
                                           getattr(given, "generation_config", None))
        self.position_limit = (model_position_limit(cfg.model_name_or_path, **hub_kwargs(cfg)) if given is None
                               else getattr(given.config.get_text_config(), "max_position_embeddings", None))
        check_completion_fits(cfg, self.position_limit)
        self.prompt_budget = prompt_token_budget(cfg, self.position_limit, self._say)
        weights = loads_weights(self.acc)  # not on every process under FSDP2's cpu_ram_efficient_loading
        self.reward_sources = build_reward_sources(cfg, self.acc.device, self._say, self.inputs.reward_funcs,
                                                   self.inputs.reward_tokenizers, weights)
        self.reward_watch = EmptySourceWatch(self.reward_sources, cfg.reward_source_max_empty_steps)
        self.policy = load_policy(cfg, given, self.inputs.peft_config, weights)
        # A generation batch that is one micro-batch is trained on at the weights its pi_old forward would run at:
        # the KL then comes from the training forward's own log-probs, detached, and that no-grad pass is skipped
        # (without dropout, the training forward computes what the eval-mode pass would).
        self.kl_from_training_forward = (self.steps_per_generation * cfg.num_iterations == 1
                                          and not has_active_dropout(self.policy))
        self.ref = load_reference(cfg, self.inputs.reference, weights)
        self.router_aux = RouterAuxLoss(self.policy, cfg.router_aux_loss_coef)  # MoE load balancing, as TRL
        self.optimizer = build_optimizer(cfg, parameter_groups(self.policy, cfg.weight_decay), self._say)
        self.total_steps = cfg.total_steps_for(self.dataset_size or 1, self.acc.num_processes)  # a stream: max_steps
        # Not passed to accelerate.prepare: its wrapper steps num_processes times per call.
        self.scheduler = build_scheduler(cfg, self.optimizer, self.total_steps)
        fill_deepspeed_config(self.acc, cfg)
        self.policy, self.optimizer = self.acc.prepare(self.policy, self.optimizer)
        self.acc.register_for_checkpointing(self.scheduler)
        ckpt.install_state_hooks(self.acc, self.policy)
        if self.ref is not None:
            self.ref = prepare_frozen_model(self.acc, self.ref)
        for source in self.reward_sources:
            if isinstance(source, RewardModelSource):
                source.place(prepare_frozen_model(self.acc, source.model), self._say)
        self.chunked_logprobs, self.share_prompts = probed_fast_paths(
            self.policy, len(self.tokenizer), self.acc.autocast, is_half_precision(self.acc.mixed_precision, cfg.dtype),
            cfg.chunked_logprobs, cfg.share_prompt_forward and not self.router_aux.enabled, self._say)  # RouterAuxLoss
        set_seed(cfg.seed, device_specific=True)  # weights are identical everywhere; sampling noise must not be
        self.backend = backend or self._default_backend()
        self.sampler = (StreamSampler(self.dataset, cfg.seed, self.acc.process_index, self.acc.num_processes)
                        if self.dataset_size is None else
                        PromptSampler(self.dataset_size, cfg.seed, cfg.shuffle_dataset, self.acc.process_index,
                                      self.acc.num_processes))
        self.feed = PromptFeed(self.dataset, self.sampler,
                               lambda p: render_prompt(self.processor or self.tokenizer, p, cfg.chat_template_kwargs),
                               cfg.per_device_train_batch_size * self.steps_per_generation // cfg.num_generations,
                               cfg.num_generations, lambda: self.backend, cfg.async_generation, self.processor is not None)
        self.global_step = 0
        self.synced_step = -1  # optimizer step whose weights the generation backend holds
        self.batch: GenerationBatch | None = None
        self.cursor = 0  # micro-batches of `self.batch` consumed, over all its iterations
        self.window: dict[str, list[float]] = defaultdict(list)
        self.last_samples: list[dict] = []
        self.reward_context = RewardContext(cfg, self.dataset_size, self.acc)  # trainer_state, log_extra, log_metric
        self.state = self.reward_context.state  # transformers' TrainerState: global_step, log_history, ...
        self.evaluation = PeriodicEvaluation(eval_datasets, cfg, self.acc, self.tokenizer, self.feed.render,
                                             self.total_steps)
        self.callbacks = EngineCallbacks(self.inputs.callbacks, self.policy, self.processing_class, self.optimizer,
                                         self.scheduler)
        self.callbacks.event("on_init_end", cfg, self.state)

    # ------------------------------------------------------------------ setup helpers
    def _sampling_params(self) -> SamplingParams:
        c = self.cfg
        return SamplingParams(c.max_completion_length, c.temperature, c.top_p, c.top_k, c.min_p,
                              c.repetition_penalty, self.prompt_budget, c.generation_kwargs,
                              tuple(self.model_eos_ids))

    def _default_backend(self) -> GenerationBackend:
        return build_backend(self.cfg, self.tokenizer, self._sampling_params(), self.acc,
                             policy_getter=lambda: self.unwrapped_policy,
                             gather=lambda: full_weights_for_generation(self.acc, self.policy),
                             record_logps=record_decoding_logprobs(self.cfg, self.unwrapped_policy),
                             position_limit=self.position_limit, say=self._say, processor=self.processor)

    def _say(self, message: str) -> None:
        """A start-up note on stderr, from the main process only."""
        if self.acc.is_main_process:
            print(message, file=sys.stderr)

    @contextmanager
    def _timed(self, name: str):
        # GPU work is asynchronous: without a sync it would be billed to whichever phase waits next.
        sync = torch.cuda.synchronize if self.acc.device.type == "cuda" else lambda: None
        sync()
        start = time.perf_counter()
        yield
        sync()
        self.window[f"timing/{name}_s"].append(time.perf_counter() - start)

    # ------------------------------------------------------------------ one generation batch
    def _generation_weights(self) -> int:
        """The step whose weights generate the next batch: this one, given to the backend first if it has others."""
        if self.synced_step != self.global_step:  # e.g. a vLLM backend holds its own weights
            self._sync_backend()
        return self.global_step

    def _prefetches(self, micro_per_batch: int) -> bool:
        """Whether the server should generate the batch after the next one while the trainer updates: only
        with `async_generation` and `max_staleness` 1, and only if the run needs another batch."""
        c = self.cfg
        if not (c.async_generation and c.max_staleness > 0):
            return False
        return (self.total_steps - self.global_step) * c.gradient_accumulation_steps > micro_per_batch

    @torch.no_grad()
    def generation_step(self, prefetch_next: bool = False) -> GenerationBatch:
        """Generates G completions for each prompt of a batch (the one in flight, else a new draw), scores them
        and computes advantages. `prefetch_next`: first send the next batch's prompts to the server."""
        c, G = self.cfg, self.cfg.num_generations
        draw = self.feed.take(self._generation_weights)
        with self._timed("generation"):  # with async_generation: the wait for the server
            rollout = self.feed.rollout(draw)
        if prefetch_next:
            self.feed.prefetch(self._generation_weights)  # it generates while this batch is scored and trained on
        if c.async_generation:
            self.window["async/staleness"].append(float(self.global_step - draw.weights_step))
        rows, rendered, conversational = draw.rows, draw.rendered, draw.conversational
        prompts = [r["prompt"] for r in rows]
        completions = self.tokenizer.batch_decode(rollout.completion_ids, skip_special_tokens=True)
        completion_ids = [ids[m.bool()].tolist() for ids, m in zip(rollout.completion_ids, rollout.completion_mask)]

        with self._timed("reward"):
            columns = {k: [v for v in col for _ in range(G)] for k, col in extra_columns(rows).items()}
            # As in TRL: with conversational prompts a reward function gets each completion as messages.
            scored_completions = [as_assistant_messages(t) for t in completions] if conversational else completions
            scored = compute_rewards(self.reward_sources, c.reward_weights, c.reward_clip_range,
                                     [p for p in prompts for _ in range(G)], scored_completions, completion_ids,
                                     columns, self.reward_context.kwargs(self.global_step, self._epoch()))
            logged_columns, logged_metrics = self.reward_context.merge(len(completions))  # the same on every process
        rewards = scored.rewards.to(self.acc.device)
        valid = scored.scorable.to(self.acc.device)
        self.reward_watch.observe(scored, self.global_step + 1)

        input_ids = torch.cat([rollout.prompt_ids, rollout.completion_ids], 1)
        attention_mask = torch.cat([rollout.prompt_mask, rollout.completion_mask], 1)
        P, mask = rollout.prompt_ids.size(1), rollout.completion_mask
        old_logps, kl, ref_logps = None, torch.zeros_like(rewards), None
        # vLLM's log-probs are never pi_old: the trainer's own forward is (here, or on-policy the training forward's,
        # detached), and `loss` compares the two. HF's decoding log-probs are the trainer's own, so they may be.
        generator_logps = rollout.generator_logps
        recorded_logps = rollout.sampling_logps if generator_logps is None else None
        truncation = (self._sampling_params().truncation()
                      if generator_logps is not None and rollout.generator_logps_processed else None)
        with self._timed("reference"):
            if c.beta > 0 or not self.on_policy or truncation:
                self.policy.eval()  # sampling-policy and reference log-probs, without dropout noise
                try:
                    old_logps = recorded_logps  # recorded while decoding (sampling_logprobs)
                    if truncation:
                        with self.acc.autocast():
                            old_logps, kept_log_mass = batched_truncated_token_logps(
                                self.policy, input_ids, attention_mask, P, c.temperature,
                                c.per_device_train_batch_size, truncation, self.share_prompts, rollout.vision)
                        # vLLM's processed log-probs are of the truncated, renormalised distribution; on the
                        # scale of the trainer's own (full) log-probs they are log mu(o) = log mu_trunc(o) + the
                        # log of the mass the truncation kept, here the trainer's at pi_old. Without this, rho
                        # and the importance weights at the sampling weights would be prod_t Z_t, not 1.
                        generator_logps = (generator_logps.to(kept_log_mass.device) + kept_log_mass) * mask
                    elif old_logps is None and not (c.beta > 0 and self.kl_from_training_forward):
                        with self.acc.autocast():  # as the reference below and the training forward
                            old_logps = batched_token_logps(self.policy, input_ids, attention_mask, P, c.temperature,
                                                            c.per_device_train_batch_size, self.chunked_logprobs,
                                                            self.share_prompts, vision=rollout.vision)
                    if c.beta > 0:
                        # accelerate's autocast wraps only the prepared model's forward; every log-prob pass runs
                        # inside it explicitly, so the chunked head (which runs after the forward) and the
                        # reference use the policy's precision, and identical models give a KL of exactly 0.
                        policy = self.unwrapped_policy
                        # Against the training forward's log-probs (old_logps None), with its kernels: identical
                        # models then give a KL of exactly 0 there too.
                        with self.acc.autocast(), reference_context(policy, self.ref):
                            ref_logps = batched_token_logps(self.ref or self.policy, input_ids, attention_mask, P,
                                                            c.temperature, c.per_device_train_batch_size,
                                                            self.chunked_logprobs, self.share_prompts,
                                                            kernels_of=policy if old_logps is None else None,
                                                            vision=rollout.vision)
                        if old_logps is not None:
                            kl = A.sequence_kl(old_logps, ref_logps, mask)  # (N,) k1 sequence KL: enters the reward
                finally:
                    self.policy.train()

        loss_weights = valid.float()
        if c.mask_truncated_completions:
            loss_weights = loss_weights * rollout.terminated.float()
        finish = dict(scored=scored, rewards=rewards, valid=valid, rollout=rollout, completions=completions,
                      samples=(rendered, logged_columns, logged_metrics))
        if c.beta > 0 and old_logps is None:  # kl_from_training_forward: `loss` finishes the advantages
            self._deferred_advantages = {**finish, "ref_logps": ref_logps}
            advantages = torch.zeros_like(rewards)  # replaced in `loss`, before any use
        else:
            advantages = self._advantages(kl=kl, **finish)
        # Each live row weighs the same in its optimizer steps, however the masked rows fall into micro-batches.
        live_per_micro_batch = max(loss_weights.sum().item(), 1.0) / self.steps_per_generation
        return GenerationBatch(input_ids, attention_mask, mask, advantages, loss_weights,
                               None if self.on_policy else old_logps, P, live_per_micro_batch,
                               None if generator_logps is None else generator_logps.to(self.acc.device), rollout.vision)

    def _advantages(self, scored, rewards, valid, rollout, completions, samples, kl) -> torch.Tensor:
        """Leave-one-out advantages of the KL-penalised rewards (N,); logs the batch's metrics and samples."""
        c, G = self.cfg, self.cfg.num_generations
        total_reward = A.kl_penalized_rewards(rewards, kl, c.beta)
        advantages = A.leave_one_out_advantages(total_reward, G, valid)
        if c.normalize_advantages:
            # Over every scorable row of every process, as TRL normalises over the gathered batch.
            advantages = A.normalize_advantages(advantages, valid, self.acc.gather(advantages),
                                                self.acc.gather(valid))
        token_kl_mean = (kl.sum() / rollout.completion_mask.sum().clamp(min=1)).item()  # TRL's `kl`: per token
        rendered, logged_columns, logged_metrics = samples
        for name, value in {**generation_metrics(scored, rewards, valid, kl, token_kl_mean, rollout, G),
                            **logged_metrics}.items():
            self.window[name].append(value)
        self.last_samples = [
            {"prompt": r, "completion": t, "reward": float(rw), **{k: v[i] for k, v in logged_columns.items()},
             "advantage": float(a)}
            for i, (r, t, rw, a) in enumerate(zip([p for p in rendered for _ in range(G)], completions, rewards, advantages))
        ]
        return advantages

    # ------------------------------------------------------------------ the loss of one micro-batch
    def loss(self, mb: dict) -> torch.Tensor:
        """Clipped sequence-ratio loss; on-policy the old log-probs are this forward's, detached (ratio == 1).
        With `ratio_anchor` resolved to `vllm` the ratio is against vLLM's log-probs instead (config.py)."""
        c = self.cfg
        with self.acc.autocast(), self.router_aux.capture(self.policy):  # autocast: the chunked head too (see ref)
            token_logps, entropy = completion_token_logps(self.policy, mb["input_ids"], mb["attention_mask"],
                                                          mb["prompt_length"], c.temperature, with_entropy=True,
                                                          chunked=self.chunked_logprobs,
                                                          # checkpointing drops the cache the shared path runs on
                                                          share_prompts=self.share_prompts and not c.gradient_checkpointing,
                                                          vision=mb["vision"])
        mask, row_weights = mb["completion_mask"], mb["loss_weights"]
        old = mb["old_token_logps"] if mb["old_token_logps"] is not None else token_logps.detach()
        if self._deferred_advantages is not None:  # this forward is pi_old of the whole batch: the KL comes from it
            deferred, self._deferred_advantages = self._deferred_advantages, None
            mb["advantages"] = self._advantages(kl=A.sequence_kl(old, deferred.pop("ref_logps"), mask), **deferred)
        anchor_logps, weights = old, None
        if mb["generator_logps"] is not None:
            weights = self._generator_weights(old, mb["generator_logps"], mask)
        if weights is not None and c.effective_ratio_anchor == "vllm":
            # rho = pi_theta / pi_vllm: the clip is a trust region around the weights that sampled the batch
            loss_mask, row_weights = A.vllm_anchor_masks(weights, mask, row_weights)
            seq_logps = A.sequence_log_probs(token_logps, loss_mask)
            anchor_logps = mb["generator_logps"]
        else:
            loss_mask = mask
            seq_logps = (A.sequence_log_probs(token_logps, mask) if weights is None
                         else A.importance_weighted_sequence_log_probs(token_logps, weights, mask))
        loss, ratio = A.clipped_sequence_loss(seq_logps, A.sequence_log_probs(anchor_logps, loss_mask),
                                              mb["advantages"], c.epsilon, c.effective_epsilon_high, row_weights,
                                              mb["loss_normalizer"])
        if self.router_aux.enabled:
            aux = self.router_aux.mean()
            loss = loss + self.router_aux.coef * aux
            self.window["aux_loss"].append(aux.item())
        clip = A.clip_ratio_metrics(ratio, mb["advantages"], c.epsilon, c.effective_epsilon_high, row_weights)
        self.window["entropy"].append(((entropy * mask).sum() / mask.sum().clamp(min=1)).item())
        for k, v in clip.items():
            self.window[f"clip_ratio/{k}"].append(v.item())
        self.window["loss"].append(loss.item())
        return loss

    # ------------------------------------------------------------------ the loop
    def train(self, resume_from_checkpoint: str | bool | None = None) -> TrainResult:
        """Trains to `total_steps`, holding the output_dir lock; an engine-created MLflow run that dies of an
        error ends FAILED (KILLED on Ctrl-C). A SIGKILL ends nothing: the next run in the directory notices.
        `resume_from_checkpoint`, as TRL's: a checkpoint directory, or True / "latest" for the newest."""
        self.logger = None
        try:
            resume = "latest" if resume_from_checkpoint is True else (resume_from_checkpoint or None)
            if resume is not None or not self.start_decided:
                self.resume_path = start_point(self.cfg, self.acc, self.inputs.describe(), resume)
                self.start_decided = True
            self.logger = MetricsLogger(self.cfg.output_dir, self.acc.is_main_process, self.cfg.run_name,
                                        {f"train.{k}": v for k, v in self.cfg.model_dump().items()},
                                        continue_run=bool(resume or self.cfg.resume_from_checkpoint),
                                        trackers=self.cfg.trackers())
            return self._train()
        except BaseException as err:
            if self.acc.is_main_process and self.logger is not None:
                self.logger.finish("KILLED" if isinstance(err, KeyboardInterrupt) else "FAILED")
            raise
        finally:
            if hasattr(self.backend, "close"):
                self.backend.close()  # e.g. leave the vLLM server's weight-transfer group, for the next run
            if self.run_lock is not None:
                self.run_lock.release()

    def _train(self) -> TrainResult:
        c = self.cfg
        out = Path(c.output_dir)
        if self.acc.is_main_process:
            out.mkdir(parents=True, exist_ok=True)
            ckpt.remove_partial_writes(out)  # a killed run's .tmp-checkpoint-N; the lock says none is being written
            save_config(c, out / "config.yaml")
        start_step = self._maybe_resume()
        # A model object may differ from the files it came from (vLLM loaded those): it is synced first.
        if start_step == 0 and getattr(self.backend, "starts_with_model_weights", False) and self.inputs.policy is None:
            self.synced_step = 0  # it loaded model_name_or_path itself: nothing has changed yet
        crash_at = crash_step()
        micro_per_batch = self.steps_per_generation * c.num_iterations
        bar = progress_bar(total=self.total_steps, initial=self.global_step, desc="rloo", unit="step",
                           dynamic_ncols=True, disable=not self.acc.is_main_process or c.disable_tqdm)
        step_start, last = time.perf_counter(), {}
        self.callbacks.event("on_train_begin", c, self.state)
        if start_step == 0 and c.eval_on_start and self.evaluation.datasets:
            self._log(train=False, evaluated=self._evaluate())  # logged at step 0, before any update
        self.policy.train()
        step_begins = True
        while self.global_step < self.total_steps:
            if step_begins:
                self.callbacks.event("on_step_begin", c, self.state)
                step_begins, epoch_before = False, self._epoch()
            if self.batch is None or self.cursor == micro_per_batch:
                self.batch, self.cursor = self.generation_step(prefetch_next=self._prefetches(micro_per_batch)), 0
            mb = self.batch.micro_batch(self.cursor % self.steps_per_generation, c.per_device_train_batch_size)
            self.cursor += 1
            with self._timed("policy_update"), self.acc.accumulate(self.policy):
                loss = self.loss(mb)
                self.acc.backward(loss)
                if self.acc.sync_gradients:
                    norm = global_grad_norm(self.acc, self.policy, c.max_grad_norm)
                    if norm is not None:
                        self.window["grad_norm"].append(norm)
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
            if not self.acc.sync_gradients:
                continue
            # ---- an optimizer step is complete
            self.window["learning_rate"].append(self.scheduler.get_last_lr()[0])
            self.scheduler.step()
            self.global_step = self.state.global_step = step_begins = self.global_step + 1
            self.state.epoch = self._epoch()
            maybe_kill(self.global_step, "step")
            self.window["step_time"].append(time.perf_counter() - step_start)
            if self.acc.device.type == "cuda":
                self.window["memory/max_allocated_gib"].append(torch.cuda.max_memory_allocated() / 2**30)
            if c.sync_ref_model and self.ref is not None and self.global_step % c.ref_model_sync_steps == 0:
                with gathered_for_update(self.acc, self.policy, self.ref):
                    sync_reference(self.unwrapped_policy, self.ref, c.ref_model_mixup_alpha)
            control = self._callback_flags(self.callbacks.event("on_step_end", c, self.state))
            evaluated = (self._evaluate() if control["should_evaluate"]
                         or self.evaluation.due(self.global_step, epoch_before, self._epoch()) else {})
            logging_due = (self.global_step % c.logging_steps == 0 or self.global_step == self.total_steps
                           or (c.logging_first_step and self.global_step == 1) or control["should_log"])
            if logging_due or evaluated:
                logged = self._log(train=logging_due, evaluated=evaluated)
                last = logged if logging_due else last
                if self.acc.is_main_process:  # TRL prints each logging step's metrics, with or without a bar
                    bar.write(metric_line(logged), file=sys.stderr)
                bar.set_postfix(reward=format_metric(last.get("reward", float("nan"))),
                                kl=format_metric(last.get("kl", 0.0)))
            maybe_kill(self.global_step, "logged")
            bar.update(1)
            if ((c.save_steps and self.global_step % c.save_steps == 0) or control["should_save"]) \
                    and self.global_step < self.total_steps:
                self._save()
                self.callbacks.event("on_save", c, self.state)
            if crash_at and self.global_step == crash_at and start_step < crash_at:
                self.acc.wait_for_everyone()
                crash(crash_at)
            if control["should_training_stop"]:
                break  # a callback's; the final model is saved below
            step_start = time.perf_counter()  # after logging and saving, so they are not billed to the next step
        bar.close()
        self.feed.drain()  # a batch the run turned out not to need: the server must finish it first
        if getattr(self.backend, "serves_after_training", False) and self.synced_step != self.global_step:
            self._sync_backend()  # a server outlives the run: leave it serving the trained policy
        final = ckpt.save_final(self.acc, self.policy, self.processing_class, out, self._fresh_policy,
                                save_merged=c.save_merged_model)
        self.logger.finish_run()
        self.callbacks.event("on_train_end", c, self.state)
        return TrainResult(self.global_step, final, self.logger.path, last, self.logger.run_id)

    def _sync_backend(self) -> None:
        """Gives the generation backend this step's weights (under ZeRO-3 gathered first, under FSDP2 as sent)."""
        with self._timed("weight_sync"), weights_for_sync(self.acc, self.policy):
            self.backend.sync_weights(self.unwrapped_policy, step=self.global_step)
        self.synced_step = self.global_step

def train(cfg: RLOOConfig) -> TrainResult:
    """Entry point of `rloo-engine train`: our own progress bar replaces the libraries' per-file ones."""
    import datasets
    import transformers

    transformers.utils.logging.disable_progress_bar()
    datasets.disable_progress_bars()
    return RLOOTrainer(cfg).train()
